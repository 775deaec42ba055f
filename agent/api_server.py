"""The agent's side of its local API (the client, the protocol and the socket's path: ``gpushare.node.api``).

Why a unix socket and root only: the Prolog and Epilog run as root on the same node and must not pay for
an interpreter round trip through Slurm; users must not be able to register or close jobs. The socket
lives in a 0700 root directory, is itself 0600, and every connection's peer credentials (SO_PEERCRED) are
checked against ``allowed_uids`` (root by default), so a permissive umask or a bind mount cannot open it.
The server is the agent's one socket server (``gpushare.agent.sockets``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Callable

from gpushare.agent.sockets import Bounds, Connection, SocketServer, peer_creds
from gpushare.node.api import MAX_REQUEST

Handler = Callable[[dict[str, Any]], dict[str, Any]]


def peer_uid(sock: socket.socket) -> int:
    return peer_creds(sock)[1]


# root's Prologs and Epilogs: a node ending many jobs at once runs that many Epilogs together (each waits for
# its answer, and the handlers queue on the agent's lock); the socket is root's alone, so its bounds are root's
API_BOUNDS = Bounds(deadline_s=5.0, max_line=MAX_REQUEST, per_uid=512, total=512, workers=16)


class ApiServer:
    """Serve ``handler`` on ``path`` (:class:`gpushare.agent.sockets.SocketServer`) until :meth:`stop`."""

    def __init__(self, path: str | os.PathLike[str], handler: Handler, allowed_uids: tuple[int, ...] = (0,),
                 bounds: Bounds = API_BOUNDS, on_trouble: Callable[[str], None] | None = None) -> None:
        self.path = Path(path)
        self.handler = handler
        self.allowed_uids = frozenset(allowed_uids)
        self._server = SocketServer(self.path, self._handle, bounds, name="agent-api", mode=0o600, dir_mode=0o700,
                                    allowed_uids=self.allowed_uids, refusal="permission denied: root only",
                                    on_trouble=on_trouble)

    def _handle(self, connection: Connection, request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        if not isinstance(request.get("op"), str):
            return {"ok": False, "error": "request must be an object with an 'op'"}, False
        return self.handler(request), False

    @property
    def server(self) -> SocketServer:
        return self._server

    def start(self) -> "ApiServer":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()
