"""The client of the agent's local API (JSON lines over a root-only unix socket), for the Prolog, Epilog and
``gpushare status``, and where each of the agent's three sockets lives.

Why a unix socket and root only: the Prolog and Epilog run as root on the same node and must not pay for
an interpreter round trip through Slurm; users must not be able to register or close jobs. The socket
lives in a 0700 root directory, is itself 0600, and every connection's peer credentials (SO_PEERCRED) are
checked against ``allowed_uids`` (root by default), so a permissive umask or a bind mount cannot open it.

Protocol: the client sends one JSON object on one line (≤ 64 KiB) with ``op``; the server answers with
one JSON object on one line: ``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``; one request per
connection. The server (``gpushare.agent.api_server``) is the agent's one socket server
(``gpushare.agent.sockets``): a whole-request deadline, caps per uid and in all, a bounded worker pool, and a
``"busy": true`` answer that :func:`call` retries within its own timeout.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpushare.errors import GpushareError

if TYPE_CHECKING:
    from gpushare.config import AgentSection

log = logging.getLogger("gpushare.agent.api")
MAX_REQUEST = 64 * 1024


def socket_path(cfg: AgentSection) -> Path:
    """The agent's socket for an ``[agent]`` config section (a 0700 directory under run_dir)."""
    return Path(cfg.run_dir) / "agent" / "agent.sock"


def live_socket_path(run_dir: str) -> Path:
    """The live socket, where a running job's owner asks for its measurements so far (any local user)."""
    return Path(run_dir) / "live" / "live.sock"


def lanes_socket_path(run_dir: str) -> Path:
    """The lanes socket, where a lane job's own processes ask for turns (any local user)."""
    return Path(run_dir) / "lanes" / "lanes.sock"


def node_name(cfg: AgentSection) -> str:
    """This node's Slurm name: ``[agent] node_name``, slurmd's own variable, else the short host name."""
    return cfg.node_name or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


class AgentUnavailable(GpushareError, OSError):
    """The agent did not answer (not running, socket missing, timeout, garbage)."""


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
    """One request to the agent; raises :class:`AgentUnavailable` on any transport problem. A ``busy``
    answer (the socket's caps, ``gpushare.agent.sockets``) is asked again until the timeout, then returned."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        reply = _call_once(path, request, deadline)
        if not reply.get("busy") or time.monotonic() + delay >= deadline:
            return reply
        time.sleep(delay)
        delay = min(delay * 2, 0.25)


def _call_once(path: str | os.PathLike[str], request: dict[str, Any], deadline: float) -> dict[str, Any]:
    data = (json.dumps(request, separators=(",", ":")) + "\n").encode()
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
