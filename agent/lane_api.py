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

Hostile input: lines ≤ 4 KiB, each complete within 5 s of its first byte (the first within 5 s of the
connect), at most ``max_sessions`` sessions in all and a quarter of that per uid (answered ``busy`` past
them), one blocking wait per session, every field validated; anything else closes the session. The server
is the agent's one socket server (``gpushare.agent.sockets``): an idle session holds no thread.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable

from gpushare.agent.lane_service import LaneRefused, LaneService
from gpushare.agent.sockets import Bounds, Connection, SocketServer, peer_creds
from gpushare.node.store import check_job

log = logging.getLogger("gpushare.agent.lanes")
MAX_LINE = 4096
DEADLINE_S = 5.0  # each request line, from its first byte (a joined session may idle between requests)
__all__ = ["LaneServer", "peer_creds"]


def lane_bounds(max_sessions: int) -> Bounds:
    """At most ``max_sessions`` sessions, a quarter of them per uid (root too), and as many workers as
    sessions: a ``lane_turn`` waits (up to 30 s) on a worker, and a waiting member must never keep the
    holder's ``lane_release`` from being served. Only joined lane jobs wait, so Slurm bounds the workers."""
    return Bounds(deadline_s=DEADLINE_S, max_line=MAX_LINE, per_uid=max(1, max_sessions // 4), total=max_sessions,
                  workers=max_sessions, reserved_uids=frozenset())


class LaneServer:
    """Serve the lane ops of ``service`` on ``path``; ``owns(job, uid, pid)`` says who may act for a job."""

    def __init__(self, path: str | os.PathLike[str], service: LaneService,
                 owns: Callable[[str, int, int], str | None], max_sessions: int = 64,
                 on_trouble: Callable[[str], None] | None = None) -> None:
        self.path = Path(path)
        self.service = service
        self.owns = owns
        self.max_sessions = max_sessions
        self._sessions: set[str] = set()
        self._lock = threading.Lock()
        # every user may connect (0666 in a 0755 directory); each request is checked by peer credentials
        self.server = SocketServer(self.path, self._handle, lane_bounds(max_sessions), name="lanes", mode=0o666,
                                   dir_mode=0o755, session=True, on_close=self._closed, on_trouble=on_trouble)

    def start(self) -> "LaneServer":
        self.server.start()
        return self

    def stop(self) -> None:
        """Stop serving and end every open session, as the agent's exit would: each client sees its
        connection close (and rejoins a restarted agent, ``lane_site``) instead of talking to a service
        that is going away."""
        self.server.stop()

    def _handle(self, connection: Connection, request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        job: str | None = connection.state.get("job")
        try:
            if not isinstance(request.get("op"), str):
                raise LaneRefused("request must be an object with an 'op'")
            reply, job = self.serve(request, job, connection.pid, connection.uid, connection.alive)
        except (LaneRefused, ValueError) as exc:
            return {"ok": False, "error": str(exc)[:300]}, job is not None  # a refused join ends the session
        connection.state["job"] = job
        return reply, True

    def _closed(self, connection: Connection) -> None:
        job = connection.state.get("job")
        if job is None:
            return
        with self._lock:
            self._sessions.discard(job)
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
