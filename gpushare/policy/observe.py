"""Observe mode on a node: the cap a job would have run under and the backstop stop it would have had. Pure.

Why: ``[policy] mode = "observe"`` is a pilot. The submit side leaves every job's request alone and records
what enforce would have done (decision ``observe``, ``would``, ``new``: gpushare/slurm_plugins/scope.py), so
such a job runs on a whole GPU and a node neither caps nor stops it. The admin judging the pilot needs the
node's half as well: the memory cap the job would have had and whether the backstop would have stopped it
(its device memory above that cap plus the backstop's tolerance for longer than its grace period, as
gpushare.agent.backstop judges a shared job). The agent feeds each sample of an observed job to
:class:`Shadow` and records what comes out (its log, the job's run summary as ``would``, and the
``observe_would_stop`` counter); nothing here acts, and a job is reported once.

No I/O and no clock: the agent passes the values in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_SHARDS = re.compile(r"(?:^|,)(?:gres[:/])?shard(?::[A-Za-z0-9_.-]+)?:(\d{1,6})(?:,|$)")


def would_share(record: dict[str, Any]) -> tuple[int, float | None, float | None] | None:
    """(shards, estimate GiB, margin GiB) a job recorded in observe mode would have been given; None when the
    job's record is not an observe decision that would have shared it."""
    if record.get("decision") != "observe" or record.get("would") != "shared":
        return None
    found = _SHARDS.search(str(record.get("new") or ""))
    if found is None or int(found.group(1)) <= 0:
        return None
    return int(found.group(1)), _gib(record.get("est_gib")), _gib(record.get("margin_gib"))


def _gib(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1 << 20
    return float(value) if ok else None


@dataclass
class Shadow:
    """The backstop's judgement on observed jobs, without its action: per (job, GPU) since when the job has
    been above its would-be cap plus ``tolerance_bytes``; past ``grace_s`` that is a would-have stop."""

    tolerance_bytes: int
    grace_s: float
    _over: dict[tuple[str, str], float] = field(default_factory=dict)
    _peak: dict[tuple[str, str], float] = field(default_factory=dict)
    _done: set[str] = field(default_factory=set)

    def check(self, now: float, job: str, cap_bytes: int, used: dict[str, float]) -> dict[str, Any] | None:
        """One sample of one observed job (device bytes of its processes per GPU); the would-have stop
        record the first time the backstop would have acted, else None."""
        if cap_bytes <= 0 or job in self._done:
            return None
        for gpu, used_bytes in used.items():
            key = (job, gpu)
            self._peak[key] = max(self._peak.get(key, 0.0), used_bytes)
            if used_bytes <= cap_bytes + self.tolerance_bytes:
                self._over.pop(key, None)
                continue
            since = self._over.setdefault(key, now)
            if now - since >= self.grace_s:
                self._done.add(job)
                return {"source": "agent-backstop", "gpu": int(gpu), "peak_bytes": int(self._peak[key]),
                        "cap_bytes": int(cap_bytes), "tolerance_bytes": int(self.tolerance_bytes),
                        "over_since": round(since, 3), "at": round(now, 3), "action": "would-stop"}
        return None

    def forget(self, job: str) -> None:
        for table in (self._over, self._peak):
            for key in [k for k in table if k[0] == job]:
                del table[key]
        self._done.discard(job)


def cap_message(job: str, cap_mib: int, shards: int) -> str:
    return (f"job {job}: observe mode: would have run shared as shard:{shards} with a {cap_mib / 1024:.2f} GiB "
            "memory cap; left on its whole GPU, uncapped")


def stop_message(job: str, record: dict[str, Any]) -> str:
    return (f"job {job}: observe mode: the backstop would have stopped it: {record['peak_bytes'] / 2**30:.2f} GiB "
            f"on GPU {record['gpu']} above its would-be cap of {record['cap_bytes'] / 2**30:.2f} GiB (+ "
            f"{record['tolerance_bytes'] / 2**30:.2f} GiB tolerance) for {record['at'] - record['over_since']:.0f} s; "
            "left running")


def summary(would_mib: int | None, stop: dict[str, Any] | None) -> dict[str, Any] | None:
    """The run summary's ``would`` entry (docs/formats.md): the would-be cap and, if it came to that, the
    stop; None for a job that was not observed."""
    if not would_mib:
        return None
    out: dict[str, Any] = {"cap_gib": round(would_mib / 1024, 2)}
    if isinstance(stop, dict):
        out["stop"] = "backstop"
        out["over_gib"] = round(float(stop.get("peak_bytes") or 0) / 2**30, 2)
    return out
