"""The lanes socket: where a lane job's own processes ask the agent for turns (JSON lines, SO_PEERCRED).

Why a second socket beside ``agent.sock``: that one is root-only by design (0700 directory, root peers
only: users must never register or close jobs). Lane requests come from the job itself, as its user, so
they get their own socket in a world-reachable directory (``<run_dir>/lanes/lanes.sock``, 0666) that
serves nothing but the lane ops, each checked against the peer's kernel-reported credentials.

Session protocol (one connection = one lane member; closing it gives up the job's turn and lane place,
which is how a crashed job's turn is reclaimed: the kernel closes a killed process's socket):

* ``{"op": "lane_join", "job": "<id>"}`` first. Accepted only when the job is registered with the agent
  as a lane job, not closed, the peer's uid is the job's uid, and the peer process belongs to the job
  (its cgroup, ``gpushare.agent.sampler.process_job``). One live session per job.
* ``{"op": "lane_turn", "wait_s": 30}`` blocks (≤ 30 s) until the job holds its lane's turn:
  ``{"ok": true, "granted": true}``, else ``"granted": false`` and the client asks again.
* ``{"op": "lane_release", "again": true}`` gives the turn back: ``"released": false`` when it had been
  taken away. ``again`` (default false) asks for the next turn in the same step, so the turn policy can
  hand it straight back (PACK, SRTF) instead of always passing it on; the following ``lane_turn`` answers
  at once when it did.
* ``{"op": "lane_status"}``: the job's lanes view.

Hostile input: lines ≤ 4 KiB, at most ``max_sessions`` sessions in all and a quarter of that per uid,
one blocking wait per session, every field validated; anything else closes the session.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import socketserver
import struct
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from gpushare.agent.api import stop_server
from gpushare.agent.lane_service import LaneRefused, LaneService
from gpushare.agent.store import check_job

log = logging.getLogger("gpushare.agent.lanes")
MAX_LINE = 4096


def lanes_socket_path(run_dir: str) -> Path:
    return Path(run_dir) / "lanes" / "lanes.sock"


def peer_creds(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer, as the kernel recorded them at connect time."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", data)
    return pid, uid, gid


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 64
    lanes: "LaneServer"


class _Session(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        owner = self.server.lanes
        try:
            pid, uid, _ = peer_creds(self.connection)
        except OSError:
            return
        if not owner.enter(uid):
            self._reply({"ok": False, "error": "too many lane sessions"})
            return
        job: str | None = None
        owner.track(self.connection)
        try:
            while True:
                line = self.rfile.readline(MAX_LINE + 1)
                if not line:
                    return  # closed (or the process died)
                if len(line) > MAX_LINE or not line.endswith(b"\n"):
                    self._reply({"ok": False, "error": "request too long or not a line"})
                    return
                try:
                    request = json.loads(line)
                    if not isinstance(request, dict) or not isinstance(request.get("op"), str):
                        raise LaneRefused("request must be an object with an 'op'")
                    reply, job = owner.serve(request, job, pid, uid, self._alive)
                except (LaneRefused, ValueError) as exc:
                    self._reply({"ok": False, "error": str(exc)[:300]})
                    if job is None:
                        return  # a refused join ends the session
                    continue
                if not self._reply(reply):
                    return
        except OSError:
            return
        finally:
            owner.untrack(self.connection)
            owner.leave(uid, job)

    def _alive(self) -> bool:
        """False once the client closed its end (or died): a peek sees end-of-file."""
        try:
            ready, _, _ = select.select([self.connection], [], [], 0)
            if not ready:
                return True
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def _reply(self, reply: dict[str, Any]) -> bool:
        try:
            self.wfile.write((json.dumps(reply, separators=(",", ":")) + "\n").encode())
            return True
        except OSError:
            return False


class LaneServer:
    """Serve the lane ops of ``service`` on ``path``; ``owns(job, uid, pid)`` says who may act for a job."""

    def __init__(self, path: str | os.PathLike[str], service: LaneService,
                 owns: Callable[[str, int, int], str | None], max_sessions: int = 64) -> None:
        self.path = Path(path)
        self.service = service
        self.owns = owns
        self.max_sessions = max_sessions
        self.per_uid = max(1, max_sessions // 4)
        self._count: Counter[int] = Counter()
        self._sessions: set[str] = set()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._server: _Server | None = None

    def start(self) -> "LaneServer":
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o755)
        self.path.unlink(missing_ok=True)
        server = _Server(str(self.path), _Session)
        os.chmod(self.path, 0o666)  # every user may connect; each request is checked by peer credentials
        server.lanes = self
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="gpushare-lanes",
                         daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop serving and end every open session, as the agent's exit would: each client sees its
        connection close (and rejoins a restarted agent, ``lane_site``) instead of talking to a service
        that is going away."""
        stop_server(self._server, self.path)
        self._server = None
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def track(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.add(connection)

    def untrack(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.discard(connection)

    def enter(self, uid: int) -> bool:
        with self._lock:
            if sum(self._count.values()) >= self.max_sessions or self._count[uid] >= self.per_uid:
                log.warning("lanes: session from uid %d refused (%d open)", uid, sum(self._count.values()))
                return False
            self._count[uid] += 1
            return True

    def leave(self, uid: int, job: str | None) -> None:
        with self._lock:
            self._count[uid] -= 1
            if job is not None:
                self._sessions.discard(job)
        if job is not None:
            self.service.leave(job, "its connection closed")

    def serve(self, request: dict[str, Any], job: str | None, pid: int, uid: int,
              alive: Callable[[], bool]) -> tuple[dict[str, Any], str | None]:
        """One request of a session whose job is ``job`` (None before ``lane_join``)."""
        op = request["op"]
        if job is None:
            if op != "lane_join":
                raise LaneRefused("the first request must be lane_join")
            wanted = check_job(str(request.get("job", ""))[:20])
            refusal = self.owns(wanted, uid, pid)
            if refusal is not None:
                log.warning("lanes: uid %d pid %d refused for job %s: %s", uid, pid, wanted, refusal)
                raise LaneRefused(refusal)
            with self._lock:
                if wanted in self._sessions:
                    raise LaneRefused(f"job {wanted} already has a lane session")
                self._sessions.add(wanted)
            try:
                return {"ok": True, **self.service.join(wanted)}, wanted
            except Exception:
                with self._lock:
                    self._sessions.discard(wanted)
                raise
        if op == "lane_turn":
            wait = request.get("wait_s", 30.0)
            if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 3600:
                raise LaneRefused("wait_s: expected seconds in 0..3600")
            return {"ok": True, **self.service.turn(job, alive, float(wait))}, job
        if op == "lane_release":
            again = request.get("again", False)
            if not isinstance(again, bool):
                raise LaneRefused("again: expected true or false")
            return {"ok": True, **self.service.release(job, again)}, job
        if op == "lane_status":
            return {"ok": True, "job": job, **self.service.snapshot()}, job
        raise LaneRefused(f"unknown op {op[:30]!r} (known: lane_join, lane_turn, lane_release, lane_status)")
