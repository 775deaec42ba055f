"""A hostile local user's slow clients: N connections to a Unix socket, each sending its request one byte a
second (faster than any per-read timeout, slower than any request deadline), reconnecting whenever the
server closes one, for a while. Prints what the server answered, as JSON, when done.

Usage: slow_clients.py SOCKET N SECONDS [BYTE_INTERVAL_S]
Run it as the flooding user (``preexec_fn=lambda: os.setuid(uid)``): the server sees that uid (SO_PEERCRED).
"""

from __future__ import annotations

import json
import selectors
import socket
import sys
import time

REQUEST = b'{"op": "live", "job": "1"}\n'


def main() -> int:
    path, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    interval = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0
    answers: dict[str, int] = {"busy": 0, "deadline": 0, "other": 0, "connects": 0, "refused_connects": 0}
    selector = selectors.DefaultSelector()
    progress: dict[socket.socket, int] = {}
    end = time.monotonic() + seconds

    def connect() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError:
            answers["refused_connects"] += 1
            sock.close()
            return
        sock.setblocking(False)
        answers["connects"] += 1
        progress[sock] = 0
        selector.register(sock, selectors.EVENT_READ)

    def closed(sock: socket.socket, data: bytes) -> None:
        text = data.decode(errors="replace")
        key = "busy" if '"busy":true' in text else "deadline" if "within" in text else "other"
        answers[key] += 1
        selector.unregister(sock)
        progress.pop(sock, None)
        sock.close()

    for _ in range(count):
        connect()
    next_byte = time.monotonic()
    while time.monotonic() < end:
        for key, _ in selector.select(max(0.0, min(next_byte, end) - time.monotonic())):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            closed(sock, data)
        if time.monotonic() >= next_byte:
            for sock in list(progress):
                try:
                    sock.send(REQUEST[progress[sock]:progress[sock] + 1])
                    progress[sock] = (progress[sock] + 1) % (len(REQUEST) - 1)  # never the newline
                except OSError:
                    closed(sock, b"")
            while len(progress) < count and time.monotonic() < end:  # keep the pressure on
                before = len(progress)
                connect()
                if len(progress) == before:
                    break
            next_byte = time.monotonic() + interval
    answers["open_at_end"] = len(progress)
    print(json.dumps(answers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
