"""The backstop's fail-safe: while the agent cannot register or attribute jobs, it stops nothing it cannot
attribute with evidence.

Why: the backstop stops a process that belongs to no job on its GPU (``Guard.check_unattributed``). That is
right only while the agent's view of which job owns which process is complete. When the agent itself is in
trouble (a sampling tick failed, a worker thread could not be started), or Slurm did not answer its
lookups, a job can run here unregistered through no fault of its own: its Prolog could not reach the agent
and its processes look like nobody's. Stopping them then kills an innocent job. So while the agent holds
(:class:`FailSafe`, a reason per trouble, each with its detail and since when), an unattributed process
over the tolerance is recorded (``action: "hold"``, with the reason), not stopped; and, always, a process
that claims a job the agent does not track is stopped only once Slurm has said that job may not run on
this GPU (:func:`hold_reason`). Its memory is never folded into another job of its user either
(``Sampler.attribute``): a job is only ever charged for processes it can be shown to own.

Said in ``gpushare status`` (``failsafe``) and in Prometheus (``gpushare_agent_failsafe{reason}``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("gpushare.agent")
REASONS = ("slurm", "tick", "threads")
THREADS_HOLD_S = 60.0  # a thread that could not be started holds the backstop this long after the last one


class FailSafe:
    """The reasons the agent holds its backstop's hand now (thread-safe; ``clock``: monotonic seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._reasons: dict[str, tuple[str, float, float | None]] = {}  # reason -> (detail, since, until)

    def hold(self, reason: str, detail: str, for_s: float | None = None) -> None:
        """Hold for ``reason`` until :meth:`clear` (or ``for_s`` after the latest call)."""
        now = self.clock()
        with self._lock:
            known = self._reasons.get(reason)
            since = known[1] if known is not None and (known[2] is None or known[2] > now) else now
            self._reasons[reason] = (detail[:300], since, None if for_s is None else now + for_s)
        if known is None or since == now:
            log.error("backstop fail-safe: %s (%s); processes the agent cannot attribute are recorded, not "
                      "stopped, until it recovers", reason, detail[:300])

    def clear(self, reason: str) -> None:
        with self._lock:
            known = self._reasons.pop(reason, None)
        if known is not None:
            log.warning("backstop fail-safe: %s recovered after %.0f s", reason, self.clock() - known[1])

    def reasons(self) -> dict[str, str]:
        """Each reason holding now, with its detail."""
        now = self.clock()
        with self._lock:
            for reason in [r for r, (_, _, until) in self._reasons.items() if until is not None and until <= now]:
                del self._reasons[reason]
            return {reason: detail for reason, (detail, _, _) in self._reasons.items()}

    def snapshot(self) -> dict[str, Any]:
        reasons = self.reasons()
        return {"holding": bool(reasons), "reasons": reasons}


def hold_reason(claim: str | None, claim_tracked: bool, claim_refused: bool, holding: dict[str, str]) -> str | None:
    """Why the backstop must not stop an unattributed process now (None: it may). Pure.

    ``claim``: the job its cgroup (or, without job cgroups, its environment) names; ``claim_tracked``: the
    agent tracks that job (the process belongs to it elsewhere, or to another user: evidence it is not this
    GPU's job); ``claim_refused``: Slurm's record of that job says it may not be adopted here;
    ``holding``: :meth:`FailSafe.reasons`."""
    if holding:
        return "agent fail-safe: " + "; ".join(f"{reason}: {detail}" for reason, detail in sorted(holding.items()))
    if claim is not None and not claim_tracked and not claim_refused:
        return f"it claims job {claim}, which runs here unregistered and Slurm has not confirmed"
    return None
