"""Salus lanes on one node (pure state): admission of lane jobs onto a GPU's lanes, and whose turn it is.

Why lanes (Salus §3-4): a training job's memory is *persistent* (weights, optimizer state: held for the
job's life) plus *ephemeral* (activations, workspace: allocated and freed within one iteration). Jobs
whose iterations never overlap can share one region for their ephemeral memory. A *lane* is such a
region: its size is the largest ephemeral of its jobs, and exactly one of them holds the lane's *turn*
(runs an iteration) at a time. A GPU admits a lane job while

    Σ persistent of the GPU's lane jobs + Σ over lanes of the lane's size ≤ capacity

so iteration-granularity time sharing inside a lane can never run the GPU out of memory.

Pure: no threads, no clock, no I/O. ``gpushare.agent.lane_service`` wraps this in a lock and a condition
variable; the unit tests drive it directly. The turn order is the pluggable :data:`TurnPolicy`:
:func:`round_robin`, or Salus' PACK / SRTF / FAIR through :func:`salus_policy`, which calls
``gpushare.policy.lane_policy.next_turn`` (the same decision the simulator makes, so the two cannot drift).
``[agent] lane_policy`` names one (:func:`turn_policy`; ``docs/agent.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from gpushare.policy.lane_policy import LanePolicy, TurnState, joining_service, next_turn


@dataclass(frozen=True)
class Waiter:
    """What a turn policy may know about one job waiting for its lane's turn.

    The last three are what Salus' policies decide on (``lane_policy.TurnState``); they have defaults so
    a policy that needs only the first five can be tried with hand-made waiters."""

    job: str
    queued_at: float  # when it asked for this turn (the service's monotonic clock)
    turns: int  # turns it has had so far
    held_s: float  # seconds it has held turns so far
    ephemeral_bytes: int
    admitted_seq: int = 0  # admission order on this node (PACK; every policy's tie-break)
    remaining_s: float = math.inf  # work left: the Slurm time limit left (SRTF)
    service_s: float = 0.0  # turn seconds received, from the lane's least service when it joined (FAIR)


TurnPolicy = Callable[[Sequence[Waiter]], str]
ROUND_ROBIN = "round-robin"
POLICY_NAMES = (ROUND_ROBIN, *(p.value for p in LanePolicy))  # what ``[agent] lane_policy`` accepts


def round_robin(waiting: Sequence[Waiter]) -> str:
    """FIFO: the job that has waited longest. A job that releases and asks again queues behind every job
    already waiting, so the jobs of a busy lane alternate (round-robin): equal *turns*, whatever each
    turn's length (FAIR equalises turn *seconds* instead)."""
    return min(waiting, key=lambda w: (w.queued_at, w.job)).job


def salus_policy(policy: LanePolicy) -> TurnPolicy:
    """A :data:`TurnPolicy` that decides with ``lane_policy.next_turn``: one implementation of PACK, SRTF
    and FAIR for the simulator and the live service."""

    def choose(waiting: Sequence[Waiter]) -> str:
        chosen = next_turn(policy, [TurnState(w.job, w.admitted_seq, w.remaining_s, w.service_s) for w in waiting])
        if chosen is None:
            raise ValueError("no job waits for the turn")
        return chosen

    choose.__name__ = policy.value
    return choose


def turn_policy(name: str) -> TurnPolicy:
    """The policy ``[agent] lane_policy`` names: ``round-robin`` or one of ``lane_policy.LanePolicy``."""
    if name == ROUND_ROBIN:
        return round_robin
    try:
        return salus_policy(LanePolicy(name))
    except ValueError:
        raise ValueError(f"unknown lane policy {name!r} (known: {', '.join(POLICY_NAMES)})") from None


def policy_name(policy: TurnPolicy) -> str:
    """How ``gpushare status`` names a policy (a function's name; the config names for the shipped ones)."""
    return ROUND_ROBIN if policy is round_robin else getattr(policy, "__name__", repr(policy))


@dataclass
class Member:
    """A lane job known to the board (admitted or pending)."""

    job: str
    gpu: int
    persistent_bytes: int
    ephemeral_bytes: int
    own_lane: bool = False  # no persistent/ephemeral split known: never shares a lane (docs/agent.md)
    lane: int | None = None  # lane id once admitted
    joined_at: float = 0.0
    deadline: float = math.inf  # when its Slurm time limit runs out (the board's clock): SRTF's remaining
    admitted_seq: int = 0  # set on admission
    service_base: float = 0.0  # FAIR: the lane's least service when it joined (lane_policy.joining_service)
    turns: int = 0
    held_s: float = 0.0
    demoted: int = 0
    skip_next: bool = False  # demoted: passed over at its lane's next grant, whatever the policy

    def service_s(self) -> float:
        return self.service_base + self.held_s


@dataclass
class Lane:
    id: int
    gpu: int
    own: bool  # a lane of one job without a known split: nobody else joins it
    members: list[str] = field(default_factory=list)
    holder: str | None = None
    held_since: float = 0.0
    waiting: dict[str, float] = field(default_factory=dict)  # job -> queued_at


class LaneBoard:
    """Every lane job of the node: lanes per GPU, pending jobs, turns. Methods return what changed."""

    def __init__(self, policy: TurnPolicy = round_robin) -> None:
        self.policy = policy
        self.members: dict[str, Member] = {}
        self.lanes: dict[int, Lane] = {}
        self.pending: list[str] = []  # not admitted yet, in arrival order
        self._next_id = 1
        self._next_seq = 0

    # -- admission ---------------------------------------------------------------------------------
    def size(self, lane: Lane) -> int:
        """A lane's size: the largest ephemeral among its jobs."""
        return max((self.members[j].ephemeral_bytes for j in lane.members), default=0)

    def used(self, gpu: int, extra_persistent: int = 0, extra_lane: int = 0) -> int:
        """Σ persistent of the GPU's admitted lane jobs + Σ lane sizes (+ a candidate's share)."""
        lanes = [lane for lane in self.lanes.values() if lane.gpu == gpu]
        persistent = sum(self.members[j].persistent_bytes for lane in lanes for j in lane.members)
        return persistent + sum(self.size(lane) for lane in lanes) + extra_persistent + extra_lane

    def place(self, member: Member, capacity: int) -> int | None:
        """The lane ``member`` may join now (an existing lane id, or -1 for a new lane); None: it must wait.

        Best fit: the smallest shared lane whose size already holds its ephemeral (it adds only its
        persistent memory); else a new lane of its own ephemeral size, if the GPU has room for both."""
        if not member.own_lane:
            fitting = [lane for lane in self.lanes.values() if lane.gpu == member.gpu and not lane.own
                       and lane.members and self.size(lane) >= member.ephemeral_bytes]
            for lane in sorted(fitting, key=lambda ln: (self.size(ln), ln.id)):
                if self.used(member.gpu, member.persistent_bytes) <= capacity:
                    return lane.id
        if self.used(member.gpu, member.persistent_bytes, member.ephemeral_bytes) <= capacity:
            return -1
        return None

    def join(self, member: Member, capacity: int) -> bool:
        """Add a job; True when admitted onto a lane now, False when it waits (pending). Idempotent."""
        known = self.members.get(member.job)
        if known is not None:
            return known.lane is not None
        self.members[member.job] = member
        self.pending.append(member.job)
        return self.admit(member.job, capacity)

    def admit(self, job: str, capacity: int) -> bool:
        """Try to admit a pending job (FIFO per GPU: a job is not overtaken by a later one on its GPU)."""
        member = self.members[job]
        if member.lane is not None:
            return True
        ahead = [j for j in self.pending[:self.pending.index(job)] if self.members[j].gpu == member.gpu]
        if ahead:
            return False
        where = self.place(member, capacity)
        if where is None:
            return False
        if where == -1:
            lane = Lane(self._next_id, member.gpu, member.own_lane)
            self._next_id += 1
            self.lanes[lane.id] = lane
            where = lane.id
        lane = self.lanes[where]
        member.service_base = joining_service([TurnState(j, self.members[j].admitted_seq, 0.0,
                                                         self.members[j].service_s()) for j in lane.members])
        lane.members.append(job)
        member.lane, member.admitted_seq = where, self._next_seq
        self._next_seq += 1
        self.pending.remove(job)
        return True

    # -- turns -------------------------------------------------------------------------------------
    def request(self, job: str, now: float) -> bool:
        """The job asks for its lane's turn; True when it holds it (now or already)."""
        member = self.members[job]
        if member.lane is None:
            return False
        lane = self.lanes[member.lane]
        if lane.holder == job:
            return True
        lane.waiting.setdefault(job, now)
        self._grant(lane, now)
        return lane.holder == job

    def release(self, job: str, now: float, again: bool = False) -> bool:
        """The job gives its turn back; False when it did not hold it (demoted meanwhile, or never had it).

        ``again``: it asks for its next turn in the same step (a training loop between two iterations), so
        the policy weighs it against the jobs already waiting: PACK and SRTF may hand the turn straight
        back, where a release followed by a separate request would always pass it on."""
        member = self.members.get(job)
        if member is None or member.lane is None:
            return False
        lane = self.lanes[member.lane]
        if lane.holder != job:
            return False
        self._end_turn(lane, now)
        if again:
            lane.waiting.setdefault(job, now)
        self._grant(lane, now)
        return True

    def leave(self, job: str, now: float) -> Member | None:
        """Forget a job (connection closed, process gone, Epilog): its turn, lane place and memory are freed."""
        member = self.members.pop(job, None)
        if member is None:
            return None
        if job in self.pending:
            self.pending.remove(job)
        if member.lane is not None:
            lane = self.lanes[member.lane]
            lane.waiting.pop(job, None)
            lane.members.remove(job)
            if lane.holder == job:
                lane.holder = None
            if lane.members:
                self._grant(lane, now)
            else:
                del self.lanes[lane.id]
        return member

    def overdue(self, now: float, limit_s: float) -> list[str]:
        """Holders past ``limit_s`` while another job of their lane waits: their turn is taken away
        (demoted); when they ask again they are passed over once, whatever the policy (under PACK or SRTF
        they would otherwise win the very next grant back)."""
        demoted = []
        for lane in self.lanes.values():
            if lane.holder is not None and lane.waiting and now - lane.held_since > limit_s:
                job = lane.holder
                self.members[job].demoted += 1
                self.members[job].skip_next = True
                self._end_turn(lane, now)
                self._grant(lane, now)
                demoted.append(job)
        return demoted

    def holder(self, job: str) -> bool:
        member = self.members.get(job)
        return member is not None and member.lane is not None and self.lanes[member.lane].holder == job

    def _end_turn(self, lane: Lane, now: float) -> None:
        assert lane.holder is not None
        self.members[lane.holder].held_s += max(0.0, now - lane.held_since)
        lane.holder = None

    def _grant(self, lane: Lane, now: float) -> None:
        if lane.holder is not None or not lane.waiting:
            return
        skipped = [j for j in lane.waiting if self.members[j].skip_next]
        candidates = [j for j in lane.waiting if j not in skipped] or list(lane.waiting)
        chosen = self.policy([self.waiter(j, lane.waiting[j], now) for j in candidates])
        if chosen not in candidates:  # a policy must pick one of the jobs it was given
            raise ValueError(f"turn policy chose {chosen!r}, not a waiting job")
        for job in skipped:
            self.members[job].skip_next = False  # passed over once (or chosen: nobody else waited)
        del lane.waiting[chosen]
        lane.holder, lane.held_since = chosen, now
        self.members[chosen].turns += 1

    def waiter(self, job: str, queued_at: float, now: float) -> Waiter:
        """What the policy sees of a waiting job at ``now``."""
        m = self.members[job]
        return Waiter(job, queued_at, m.turns, m.held_s, m.ephemeral_bytes, m.admitted_seq,
                      max(0.0, m.deadline - now), m.service_s())

    def snapshot(self) -> list[dict[str, Any]]:
        """Lanes for ``gpushare status`` and the tests."""
        return [{"lane": lane.id, "gpu": lane.gpu, "own": lane.own, "size_bytes": self.size(lane),
                 "jobs": list(lane.members), "holder": lane.holder, "waiting": list(lane.waiting)}
                for lane in sorted(self.lanes.values(), key=lambda ln: ln.id)] + [
                {"lane": None, "gpu": self.members[j].gpu, "pending": j} for j in self.pending]
