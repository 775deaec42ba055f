"""The live socket: a running job's owner asks the agent on its node for the job's measurements so far.

Why a third socket beside ``agent.sock`` (root only) and the lanes socket: ``gpushare jobstats`` on a running
job had nothing to show before the node Epilog stored its summary. The numbers exist in the agent while
the job runs, and the job's owner reaches its node with ``srun --jobid=<id> --overlap``. This socket
(``<run_dir>/live/live.sock``, 0666 in a 0755 directory) serves one read-only op and nothing else::

    {"op": "live", "job": "<id>"}  ->  {"ok": true, "run": {...the run summary so far...}, "node": "n1"}

Each request is checked against the peer's kernel-reported uid (SO_PEERCRED): root, or the uid the job
was registered with. A job that is not running here and a job of another user get the same answer, so
the socket does not tell who runs what. One request per connection, a line of at most 1 KiB, within a
whole-request deadline; a few connections per uid (``gpushare.agent.sockets``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

from gpushare.agent.sockets import Bounds, Connection, SocketServer

log = logging.getLogger("gpushare.agent.live")
MAX_REQUEST = 1024
Handler = Callable[[str, int], dict[str, Any]]  # (job id, peer uid) -> reply
# any local user may connect: a few connections per uid, a short deadline, two workers (the handler takes
# the agent's lock for a moment); root is not counted against the total
LIVE_BOUNDS = Bounds(deadline_s=2.0, max_line=MAX_REQUEST, per_uid=8, total=64, workers=2)


class LiveServer:
    """Serve ``handler`` on ``path`` (any local user may connect; the handler checks the uid)."""

    def __init__(self, path: str | os.PathLike[str], handler: Handler, bounds: Bounds = LIVE_BOUNDS,
                 on_trouble: Callable[[str], None] | None = None) -> None:
        self.path = Path(path)
        self.handler = handler
        # every user may connect (0666 in a 0755 directory); each request is checked by peer credentials
        self.server = SocketServer(self.path, self._handle, bounds, name="agent-live", mode=0o666, dir_mode=0o755,
                                   on_trouble=on_trouble)

    def _handle(self, connection: Connection, request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        if request.get("op") != "live" or not isinstance(request.get("job"), str):
            return {"ok": False, "error": 'expected one line: {"op": "live", "job": "<id>"}'}, False
        return self.handler(request["job"], connection.uid), False

    def start(self) -> "LiveServer":
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()
