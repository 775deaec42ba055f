"""The agent's one socket server (gpushare.agent.sockets) against slow and many clients: real sockets, real
threads, and flooding clients that are real processes of another uid (SO_PEERCRED is the kernel's word)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpushare.agent.api_server import ApiServer
from gpushare.node.api import call
from gpushare.agent.live_api import LiveServer
from gpushare.agent.sockets import Admission, Bounds, SocketServer

NOBODY = 65534
OTHER = 65533  # a second ordinary uid
HERE = Path(__file__).parent
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs clients as other uids (setuid)")


@pytest.fixture
def served_dir() -> Iterator[Path]:
    """A folder other uids can reach (pytest's tmp_path is under a 0700 folder; the sockets' own folders are
    made by the servers)."""
    base = Path(tempfile.mkdtemp(prefix="gpushare-sockets-", dir="/tmp"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def live_handler(job: str, uid: int) -> dict:
    return {"ok": True, "job": job, "uid": uid}


def read_line(sock: socket.socket, timeout_s: float) -> dict:
    sock.settimeout(timeout_s)
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return json.loads(data)


AS_UID = """
import json, socket, sys, time
start = time.monotonic()
with socket.socket(socket.AF_UNIX) as s:
    s.settimeout(10)
    s.connect(sys.argv[1])
    s.sendall((json.dumps({"op": "live", "job": "7"}) + "\\n").encode())
    reply = json.loads(s.makefile().readline())
print(json.dumps({"reply": reply, "seconds": time.monotonic() - start}))
"""


def ask_as(uid: int, path: Path) -> dict:
    done = subprocess.run([sys.executable, "-S", "-c", AS_UID, str(path)], capture_output=True, text=True,
                          timeout=30, preexec_fn=lambda: os.setuid(uid), check=True)
    return json.loads(done.stdout)


def test_a_byte_a_second_client_is_cut_at_the_whole_request_deadline(served_dir):
    """The live socket's deadline is 2 s for the whole request: a client sending a byte every 0.5 s (well
    within any per-read timeout) is answered with the deadline error and closed at about 2 s, not held."""
    server = LiveServer(served_dir / "live" / "live.sock", live_handler).start()
    try:
        with socket.socket(socket.AF_UNIX) as slow:
            slow.connect(str(server.path))
            started = time.monotonic()
            slow.settimeout(0.5)
            reply = b""
            while time.monotonic() - started < 8.0:
                try:
                    slow.send(b"{")
                except OSError:
                    break
                try:
                    chunk = slow.recv(4096)
                except TimeoutError:
                    continue
                reply += chunk
                if not chunk or reply.endswith(b"\n"):
                    break
            held = time.monotonic() - started
        assert held < 4.0, f"a trickling client was held {held:.1f} s"
        assert "within 2 s" in json.loads(reply)["error"]
    finally:
        server.stop()


def test_admission_counts_each_uid_and_the_total_and_reserves_root():
    admission = Admission(Bounds(deadline_s=1.0, max_line=64, per_uid=2, total=3, workers=1))
    assert admission.enter(1000) is None and admission.enter(1000) is None
    assert "per uid" in (admission.enter(1000) or "")
    assert admission.enter(1001) is None
    assert "connections open" in (admission.enter(1002) or "")  # the total, for another uid
    assert admission.enter(0) is None and admission.enter(0) is None  # root: its own cap only
    assert "per uid" in (admission.enter(0) or "")
    admission.leave(1000)
    assert admission.enter(1002) is None


@needs_root
def test_past_its_cap_a_uid_is_answered_busy_at_once_and_another_uid_is_served(served_dir):
    """Eight connections of one uid are the live socket's cap per uid: the ninth is answered busy at once
    (one line, the client's ``call`` understands it), while another uid's request is answered."""
    server = LiveServer(served_dir / "live" / "live.sock", live_handler).start()
    held: list[socket.socket] = []
    try:
        for _ in range(8):  # idle, within the deadline: they count
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(str(server.path))
            held.append(sock)
        with socket.socket(socket.AF_UNIX) as ninth:
            ninth.connect(str(server.path))
            reply = read_line(ninth, 1.0)
        assert reply["ok"] is False and reply["busy"] is True and reply["error"].startswith("busy: ")
        other = ask_as(NOBODY, server.path)
        assert other["reply"] == {"ok": True, "job": "7", "uid": NOBODY}
    finally:
        for sock in held:
            sock.close()
        server.stop()


def test_call_retries_a_busy_answer_within_its_timeout(tmp_path):
    gate = threading.Event()

    def handler(connection, request):
        gate.wait(5)
        return {"ok": True}, False

    bounds = Bounds(deadline_s=2.0, max_line=1024, per_uid=1, total=1, workers=1, reserved_uids=frozenset())
    server = SocketServer(tmp_path / "s.sock", handler, bounds, name="test").start()
    try:
        first = threading.Thread(target=call, args=(server.path, {"op": "x"}, 5.0))
        first.start()
        deadline = time.monotonic() + 5
        while not server.admission.count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert call(server.path, {"op": "x"}, timeout_s=0.3)["busy"] is True  # still busy at its timeout
        threading.Timer(0.3, gate.set).start()
        assert call(server.path, {"op": "x"}, timeout_s=5.0) == {"ok": True}  # asked again until served
        first.join(10)
    finally:
        gate.set()
        server.stop()


@needs_root
@pytest.mark.hostile
def test_a_slow_client_flood_from_one_uid_delays_neither_roots_api_nor_another_uid(served_dir):
    """80 byte-a-second connections from one uid against the live socket (mode 0666): the agent's thread
    count stays bounded (no thread per connection), root's API answers as fast as before the flood, and
    another uid's live request is answered at once."""
    base = served_dir
    live = LiveServer(base / "live" / "live.sock", live_handler).start()
    api = ApiServer(base / "agent" / "agent.sock", lambda request: {"ok": True}).start()

    def api_seconds() -> float:
        started = time.monotonic()
        assert call(api.path, {"op": "ping"}, timeout_s=5.0) == {"ok": True}
        return time.monotonic() - started

    flood = None
    try:
        before = max(api_seconds() for _ in range(5))
        threads_before = threading.active_count()
        flood = subprocess.Popen([sys.executable, "-S", str(HERE / "slow_clients.py"), str(live.path), "80", "8"],
                                 stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.setuid(NOBODY))
        deadline = time.monotonic() + 20
        while live.server.counters["busy"] < 20:  # the flood is on: its uid is past its cap
            assert time.monotonic() < deadline and flood.poll() is None, "the flood never reached the socket"
            time.sleep(0.05)
        during = [api_seconds() for _ in range(10)]
        other = ask_as(OTHER, live.path)
        threads_during = threading.active_count()
        out, _ = flood.communicate(timeout=60)
        answers = json.loads(out)
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
            flood.wait(10)
        live.stop()
        api.stop()
    assert other["reply"] == {"ok": True, "job": "7", "uid": OTHER} and other["seconds"] < 1.0, other
    assert max(during) < max(0.5, 10 * before), (before, during)
    assert threads_during - threads_before <= live.server.bounds.workers + 1, (threads_before, threads_during)
    assert answers["busy"] > 0 and answers["deadline"] > 0, answers
    assert answers["open_at_end"] <= live.server.bounds.per_uid, answers
