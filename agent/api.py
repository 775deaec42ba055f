"""The agent's local API: JSON lines over a root-only unix socket, for the Prolog, Epilog and ``gpushare status``.

Why a unix socket and root only: the Prolog and Epilog run as root on the same node and must not pay for
an interpreter round trip through Slurm; users must not be able to register or close jobs. The socket
lives in a 0700 root directory, is itself 0600, and every connection's peer credentials (SO_PEERCRED) are
checked against ``allowed_uids`` (root by default), so a permissive umask or a bind mount cannot open it.

Protocol: the client sends one JSON object on one line (≤ 64 KiB) with ``op``; the server answers with
one JSON object on one line: ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``. One request
per connection keeps the server trivially robust against slow or broken clients (each has a deadline).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import struct
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from gpushare.errors import GpushareError

if TYPE_CHECKING:
    from gpushare.config import AgentSection

log = logging.getLogger("gpushare.agent.api")
MAX_REQUEST = 64 * 1024
Handler = Callable[[dict[str, Any]], dict[str, Any]]


def socket_path(cfg: AgentSection) -> Path:
    """The agent's socket for an ``[agent]`` config section (a 0700 directory under run_dir)."""
    return Path(cfg.run_dir) / "agent" / "agent.sock"


def node_name(cfg: AgentSection) -> str:
    """This node's Slurm name: ``[agent] node_name``, slurmd's own variable, else the short host name."""
    return cfg.node_name or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


class AgentUnavailable(GpushareError, OSError):
    """The agent did not answer (not running, socket missing, timeout, garbage)."""


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    # socketserver listens with a backlog of 5; an AF_UNIX connect beyond the backlog fails at once with
    # EAGAIN (not a wait), and a node ending many jobs at once runs that many Epilogs together
    request_queue_size = 256
    handler: Handler
    allowed_uids: frozenset[int]


class _Connection(socketserver.StreamRequestHandler):
    timeout = 5.0
    server: _Server

    def handle(self) -> None:
        try:
            uid = peer_uid(self.connection)
            if uid not in self.server.allowed_uids:
                log.warning("refused API connection from uid %d", uid)
                self._reply({"ok": False, "error": "permission denied: root only"})
                return
            line = self.rfile.readline(MAX_REQUEST + 1)
            if len(line) > MAX_REQUEST or not line.endswith(b"\n"):
                self._reply({"ok": False, "error": "request too long or not a line"})
                return
            request = json.loads(line)
            if not isinstance(request, dict) or not isinstance(request.get("op"), str):
                self._reply({"ok": False, "error": "request must be an object with an 'op'"})
                return
            reply = self.server.handler(request)
        except (OSError, ValueError) as exc:
            reply = {"ok": False, "error": f"bad request: {exc}"}
        except Exception as exc:  # noqa: BLE001 - a handler bug must not kill the server thread silently
            log.exception("API handler failed")
            reply = {"ok": False, "error": f"agent error: {exc.__class__.__name__}: {exc}"}
        self._reply(reply)

    def _reply(self, reply: dict[str, Any]) -> None:
        try:
            self.wfile.write((json.dumps(reply, default=str, separators=(",", ":")) + "\n").encode())
        except OSError:
            pass


class ApiServer:
    """Serve ``handler`` on ``path`` in background threads until :meth:`stop`."""

    def __init__(self, path: str | os.PathLike[str], handler: Handler, allowed_uids: tuple[int, ...] = (0,)) -> None:
        self.path = Path(path)
        self.handler = handler
        self.allowed_uids = frozenset(allowed_uids)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "ApiServer":
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)
        self.path.unlink(missing_ok=True)  # a stale socket from a killed agent
        old_umask = os.umask(0o177)
        try:
            server = _Server(str(self.path), _Connection)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        server.handler = self.handler
        server.allowed_uids = self.allowed_uids
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="gpushare-agent-api", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        stop_server(self._server, self.path)
        self._server = None


def stop_server(server: socketserver.BaseServer | None, path: Path) -> None:
    """Stop a socket server started with ``serve_forever`` in a thread, and remove its socket file."""
    if server is not None:
        server.shutdown()
        server.server_close()
    path.unlink(missing_ok=True)


def _connect(sock: socket.socket, path: str, deadline: float) -> None:
    """Connect within the deadline. A full listen backlog makes an AF_UNIX connect fail at once with
    EAGAIN rather than wait, so that (and only that) is retried until the deadline."""
    delay = 0.01
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + delay >= deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


def call(path: str | os.PathLike[str], request: dict[str, Any], timeout_s: float = 3.0) -> dict[str, Any]:
    """One request to the agent; raises :class:`AgentUnavailable` on any transport problem."""
    data = (json.dumps(request, separators=(",", ":")) + "\n").encode()
    deadline = time.monotonic() + timeout_s
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            _connect(sock, str(path), deadline)
            try:
                sock.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered (a refusal) and closed before reading: its reply is still there
            chunks = []
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                if chunk.endswith(b"\n"):
                    break
    except OSError as exc:
        raise AgentUnavailable(f"agent at {path}: {exc.strerror or exc}") from exc
    try:
        reply = json.loads(b"".join(chunks))
    except ValueError as exc:
        raise AgentUnavailable(f"agent at {path}: garbled reply") from exc
    if not isinstance(reply, dict):
        raise AgentUnavailable(f"agent at {path}: reply is not an object")
    return reply
