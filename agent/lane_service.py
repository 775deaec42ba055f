"""The lane service: :class:`~gpushare.agent.lanes.LaneBoard` behind one lock, with blocking turn waits.

Lock order (all of it in ``gpushare.agent.daemon``): this condition is taken before the agent's lock (``facts``
reads the job store), never after; the agent calls :meth:`leave` only after letting go of its own lock.

Why its own lock and condition: a turn wait can last as long as a neighbour's training iteration. It runs
on the waiting client's connection thread (``gpushare.agent.lane_api``) and sleeps on this condition,
never on the agent's sampling lock, so the sampling loop and the Prolog/Epilog API are never held up by
lanes. Waits wake at least every ``POLL_S`` to demote overdue holders and to notice a client that went away.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from gpushare.agent.lanes import LaneBoard, Member, TurnPolicy, policy_name, turn_policy

log = logging.getLogger("gpushare.agent.lanes")
POLL_S = 0.2
MAX_WAIT_S = 30.0  # one lane_turn request waits at most this long, then answers "not yet" (the client asks again)


class LaneRefused(ValueError):
    """A lane request the agent will not serve (message safe to send to the client)."""


@dataclass(frozen=True)
class LaneFacts:
    """What the agent's job store says about a lane job (``Agent.lane_facts``)."""

    job: str
    uid: int
    gpu: int
    persistent_bytes: int
    ephemeral_bytes: int
    own_lane: bool
    capacity_bytes: int  # the GPU's memory left to lane jobs
    remaining_s: float = math.inf  # its Slurm time limit left when these facts were read (SRTF)


class LaneService:
    """``policy``: a :data:`~gpushare.agent.lanes.TurnPolicy`, or its ``[agent] lane_policy`` name."""

    def __init__(self, facts: Callable[[str], LaneFacts], policy: TurnPolicy | str = "fair",
                 turn_limit_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.facts = facts
        self.board = LaneBoard(turn_policy(policy) if isinstance(policy, str) else policy)
        self.turn_limit_s = turn_limit_s
        self.clock = clock
        self.cond = threading.Condition()
        self.demotions = 0

    def join(self, job: str) -> dict[str, Any]:
        """Put a registered lane job on its GPU's lanes (or the pending list); its identity was checked."""
        facts = self.facts(job)
        now = self.clock()
        member = Member(job, facts.gpu, facts.persistent_bytes, facts.ephemeral_bytes, facts.own_lane,
                        joined_at=now, deadline=now + max(0.0, facts.remaining_s))
        with self.cond:
            admitted = self.board.join(member, facts.capacity_bytes)
            lane = self.board.members[job].lane
            log.info("job %s: lane job on GPU %d (persistent %d MiB, ephemeral %d MiB%s): %s", job, facts.gpu,
                     facts.persistent_bytes >> 20, facts.ephemeral_bytes >> 20, ", own lane" if facts.own_lane else "",
                     f"lane {lane}" if admitted else "waits for room")
            self.cond.notify_all()
            return {"admitted": admitted, "lane": lane}

    def turn(self, job: str, alive: Callable[[], bool], wait_s: float) -> dict[str, Any]:
        """Wait until ``job`` holds its lane's turn, at most ``wait_s``; ``alive()`` false ends the wait."""
        deadline = self.clock() + max(0.0, min(wait_s, MAX_WAIT_S))
        with self.cond:
            while True:
                if job not in self.board.members:
                    raise LaneRefused("not a lane member (left, or closed by its Epilog)")
                self._demote(self.clock())
                member = self.board.members[job]
                admitted = member.lane is not None or self._admit_pending(member.gpu, job)
                if admitted and self.board.request(job, self.clock()):
                    return {"granted": True, "lane": self.board.members[job].lane}
                if self.clock() >= deadline or not alive():
                    return {"granted": False, "admitted": admitted}
                self.cond.wait(POLL_S)

    def release(self, job: str, again: bool = False) -> dict[str, Any]:
        """Give the turn back; ``again``: and ask for the next one in the same step (``LaneBoard.release``)."""
        with self.cond:
            member = self.board.members.get(job)
            if member is None:
                raise LaneRefused("not a lane member")
            held = self.board.release(job, self.clock(), again)
            self.cond.notify_all()
            # not held: its turn was taken away (demoted) while it ran, or it never had one
            return {"released": held, "demoted": member.demoted}

    def leave(self, job: str, why: str) -> bool:
        """Forget a job (its connection closed, its process died, its Epilog closed it); True if known."""
        with self.cond:
            member = self.board.leave(job, self.clock())
            if member is None:
                return False
            log.info("job %s: left its lane (%s)", job, why)
            self._admit_pending(member.gpu)
            self.cond.notify_all()
            return True

    def holders(self) -> frozenset[str]:
        """The jobs holding their lane's turn now (the backstop holds the others to their charge)."""
        with self.cond:
            return frozenset(lane.holder for lane in self.board.lanes.values() if lane.holder is not None)

    def snapshot(self) -> dict[str, Any]:
        with self.cond:
            return {"lanes": self.board.snapshot(), "demotions": self.demotions, "turn_limit_s": self.turn_limit_s,
                    "policy": policy_name(self.board.policy)}

    def _demote(self, now: float) -> None:
        for job in self.board.overdue(now, self.turn_limit_s):
            self.demotions += 1
            log.warning("job %s: held its lane turn longer than %.1f s while others waited; turn taken away "
                        "(demoted to the back of its lane)", job, self.turn_limit_s)
            self.cond.notify_all()

    def _admit_pending(self, gpu: int, job: str | None = None) -> bool:
        """Retry admission of the GPU's pending jobs in order (capacity re-read: neighbours may have ended)."""
        for pending in [j for j in self.board.pending if self.board.members[j].gpu == gpu]:
            try:
                capacity = self.facts(pending).capacity_bytes
            except LaneRefused:
                continue
            if not self.board.admit(pending, capacity):
                break
            log.info("job %s: admitted onto lane %s", pending, self.board.members[pending].lane)
        return job is not None and job in self.board.members and self.board.members[job].lane is not None
