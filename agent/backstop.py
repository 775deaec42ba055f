"""The memory backstop a job cannot opt out of, and the record shapes the OOM recovery consumes. Pure.

Why a backstop besides the framework caps: ``per_process_memory_fraction`` binds only allocations made
through PyTorch's caching allocator; a script can unset it, call ``cudaMalloc`` through another library,
or run a framework we do not cap. The agent sees every process's device memory (NVML per-process used
memory, summed over the job's processes on each GPU) and compares it with the job's cap (its estimate +
margin, ``caps.mem_limit_mib``) plus a tolerance. A job above that for longer than the grace period is
stopped: its neighbours' memory is what it is eating into.

The grace period absorbs a transient spike (a cuDNN workspace that is freed again at once); the tolerance
absorbs the CUDA context and allocator rounding our estimate may not count.

Record shapes (in the job's store entry and its run record, ``docs/agent.md`` *OOM records*)::

    oom: {"source": "agent-backstop", "gpu": int, "peak_bytes": int, "cap_bytes": int,
          "tolerance_bytes": int, "over_since": float, "at": float, "action": "stop" | "record",
          "lane": "turn" | "off-turn" (lane jobs only)}
    unattributed (agent status, not a job's): {"source": "agent-unattributed", "gpu": int, "pid": int,
          "uid": int, "claimed_job": str | None, "peak_bytes": int, "tolerance_bytes": int,
          "over_since": float, "at": float, "action": "stop" | "record" | "hold",
          "held": str (with "hold" only: why it was not stopped, gpushare.agent.failsafe)}
    forecast: {"source": "agent-forecast", "gpu": int, "at": float, "cap_bytes": int,
               "predicted_bytes": int, "horizon_s": float, "eta_s": float | None,
               "trend_bytes_per_s": float, "action": "warn" | "requeue" | "none",
               "outcome": "warned" | "requeued" | "requeue-failed" | "recorded"}

No I/O and no clock: the agent (and the simulator) pass the values in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ACTIONS = ("stop", "record", "none")


@dataclass(frozen=True)
class Verdict:
    """``ok`` (within cap + tolerance), ``over`` (over, still in grace) or ``act`` (over past the grace)."""

    state: str
    over_since: float | None


def judge(used_bytes: float, cap_bytes: float, tolerance_bytes: float, grace_s: float, now: float,
          over_since: float | None) -> Verdict:
    """One backstop check of one job on one GPU; ``over_since`` is what the last check returned."""
    if cap_bytes <= 0 or used_bytes <= cap_bytes + tolerance_bytes:
        return Verdict("ok", None)
    since = now if over_since is None else over_since
    return Verdict("act" if now - since >= grace_s else "over", since)


def oom_record(gpu: int, peak_bytes: float, cap_bytes: float, tolerance_bytes: float, over_since: float,
               now: float, action: str, lane: str | None = None) -> dict[str, Any]:
    """The job's ``oom`` entry: an OOM of its own, found by the agent (the recovery path reads it).
    ``lane``: for a lane job, whether it held its lane's turn ("turn") or not ("off-turn": held to its charge)."""
    record = {"source": "agent-backstop", "gpu": int(gpu), "peak_bytes": int(peak_bytes), "cap_bytes": int(cap_bytes),
              "tolerance_bytes": int(tolerance_bytes), "over_since": round(over_since, 3), "at": round(now, 3),
              "action": action}
    if lane is not None:
        record["lane"] = lane
    return record


def unattributed_record(gpu: int, pid: int, uid: int, claim: str | None, used_bytes: float,
                        tolerance_bytes: float, over_since: float, now: float, action: str) -> dict[str, Any]:
    """A process that belongs to no job on its GPU, over the tolerance past the grace period: what the
    agent keeps (its status, its log) about it and what it did. Billed to nobody."""
    return {"source": "agent-unattributed", "gpu": int(gpu), "pid": int(pid), "uid": int(uid),
            "claimed_job": claim, "peak_bytes": int(used_bytes), "tolerance_bytes": int(tolerance_bytes),
            "over_since": round(over_since, 3), "at": round(now, 3), "action": action}


def unattributed_message(record: dict[str, Any]) -> str:
    claim = f"claiming job {record['claimed_job']}" if record["claimed_job"] else "carrying no job id"
    verb = {"stop": "stopped", "hold": f"not stopped ({record.get('held')})"}.get(record["action"], "recorded")
    return (f"process {record['pid']} of uid {record['uid']} on GPU {record['gpu']}, {claim}, belongs to no job "
            f"of its user on that GPU and used {record['peak_bytes'] / (1 << 30):.2f} GiB for "
            f"{record['at'] - record['over_since']:.0f} s: {verb}")


def oom_message(job: str, record: dict[str, Any]) -> str:
    """The line written into the job's own log (the user reads why the job stopped)."""
    gib = 1 << 30
    verb = "stopped" if record["action"] == "stop" else "over its cap"
    cap = ("what it is charged outside its lane turn (it did not hold the turn: waiting, demoted, or not in "
           "its lane)" if record.get("lane") == "off-turn" else "its cap")
    return (f"gpushare-agent: GPU out of memory (backstop): job {job} {verb}: its processes used "
            f"{record['peak_bytes'] / gib:.2f} GiB on GPU {record['gpu']}, over {cap} of "
            f"{record['cap_bytes'] / gib:.2f} GiB (+{record['tolerance_bytes'] / gib:.2f} GiB tolerance) for "
            f"{record['at'] - record['over_since']:.0f} s. The GPU is shared; ask for more memory "
            "(#GPUSHARE mem=...) or let the OOM recovery rerun it with a larger share.\n")


def forecast_record(gpu: int, now: float, cap_bytes: float, predicted_bytes: float, horizon_s: float,
                    eta_s: float | None, trend: float, action: str) -> dict[str, Any]:
    """The job's ``forecast`` entry (MIGM §3.2.3 forecast that fired); ``outcome`` is set by the driver."""
    return {"source": "agent-forecast", "gpu": int(gpu), "at": round(now, 3), "cap_bytes": int(cap_bytes),
            "predicted_bytes": int(predicted_bytes), "horizon_s": float(horizon_s),
            "eta_s": None if eta_s is None else round(eta_s, 1), "trend_bytes_per_s": round(trend, 1),
            "action": action, "outcome": "recorded"}


def forecast_message(job: str, record: dict[str, Any]) -> str:
    gib = 1 << 30
    eta = "soon" if record["eta_s"] is None else f"in about {record['eta_s']:.0f} s"
    then = {"requeue": "it is being requeued early onto a larger share",
            "warn": "it keeps running; it will be stopped if it goes past its cap"}.get(record["action"], "")
    return (f"gpushare-agent: warning: job {job} is forecast to run out of its GPU memory share {eta} "
            f"(growing {record['trend_bytes_per_s'] / (1 << 20):.1f} MiB/s; up to "
            f"{record['predicted_bytes'] / gib:.2f} GiB within {record['horizon_s']:.0f} s, cap "
            f"{record['cap_bytes'] / gib:.2f} GiB on GPU {record['gpu']}); {then}.\n")
