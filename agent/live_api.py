"""The live socket: a running job's owner asks the agent on its node for the job's measurements so far.

Why a third socket beside ``agent.sock`` (root only) and the lanes socket: ``gpushare jobstats`` on a running
job had nothing to show before the node Epilog stored its summary. The numbers exist in the agent while
the job runs, and the job's owner reaches its node with ``srun --jobid=<id> --overlap``. This socket
(``<run_dir>/live/live.sock``, 0666 in a 0755 directory) serves one read-only op and nothing else::

    {"op": "live", "job": "<id>"}  ->  {"ok": true, "run": {...the run summary so far...}, "node": "n1"}

Each request is checked against the peer's kernel-reported uid (SO_PEERCRED): root, or the uid the job
was registered with. A job that is not running here and a job of another user get the same answer, so
the socket does not tell who runs what. One request per connection, a line of at most 1 KiB, a deadline.
"""

from __future__ import annotations

import json
import logging
import os
import socketserver
import threading
from pathlib import Path
from typing import Any, Callable

from gpushare.agent.api import peer_uid, stop_server

log = logging.getLogger("gpushare.agent.live")
MAX_REQUEST = 1024
Handler = Callable[[str, int], dict[str, Any]]  # (job id, peer uid) -> reply


def live_socket_path(run_dir: str) -> Path:
    return Path(run_dir) / "live" / "live.sock"


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    handler: Handler


class _Connection(socketserver.StreamRequestHandler):
    timeout = 2.0
    server: _Server

    def handle(self) -> None:
        try:
            uid = peer_uid(self.connection)
            line = self.rfile.readline(MAX_REQUEST + 1)
            request = json.loads(line) if len(line) <= MAX_REQUEST and line.endswith(b"\n") else None
            if not isinstance(request, dict) or request.get("op") != "live" or not isinstance(request.get("job"), str):
                reply = {"ok": False, "error": 'expected one line: {"op": "live", "job": "<id>"}'}
            else:
                reply = self.server.handler(request["job"], uid)
        except (OSError, ValueError) as exc:
            reply = {"ok": False, "error": f"bad request: {str(exc)[:80]}"}
        except Exception as exc:  # noqa: BLE001 - a handler bug must not kill the server thread silently
            log.exception("live handler failed")
            reply = {"ok": False, "error": f"agent error: {exc.__class__.__name__}"}
        try:
            self.wfile.write((json.dumps(reply, default=str, separators=(",", ":")) + "\n").encode())
        except OSError:
            pass


class LiveServer:
    """Serve ``handler`` on ``path`` (any local user may connect; the handler checks the uid)."""

    def __init__(self, path: str | os.PathLike[str], handler: Handler) -> None:
        self.path = Path(path)
        self.handler = handler
        self._server: _Server | None = None

    def start(self) -> "LiveServer":
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o755)
        self.path.unlink(missing_ok=True)
        server = _Server(str(self.path), _Connection)
        os.chmod(self.path, 0o666)  # every user may connect; each request is checked by peer credentials
        server.handler = self.handler
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="gpushare-agent-live",
                         daemon=True).start()
        return self

    def stop(self) -> None:
        stop_server(self._server, self.path)
        self._server = None
