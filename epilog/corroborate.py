"""Whether a job's OOM message is backed by something the user cannot write: gpushare's own records.

Why: a log line is the user's text. A ``shard:1`` job that prints PyTorch's OOM message and exits 1 would
otherwise be re-run on a whole GPU, and many cheap jobs could repeat that. So the whole-GPU (or larger MIG)
re-run is granted only when root-written records agree that the job really filled its share:

- the job was sized by gpushare (its ``gpushare:`` AdminComment record says ``decision: shared``); a job
  that asked for shards itself gets no free upgrade (MIG slices are exempt from this part: their memory
  limit is enforced by the hardware, and the upgrade is one profile);
- and the node agent measured the job's device memory at least ``[oom] corroborate_fraction`` of its share,
  either in the record's ``run.peak_gib`` (written by the agent and the node Epilog) or in the per-job
  record under ``[agent] records_dir`` when the controller can read it (co-located or shared).

NVML reports no per-process "out of memory" event, so the device itself cannot testify; peak memory near
the cap is the evidence a real OOM leaves. ``[oom] corroborate = "no"`` restores trust in the log alone.

A *collateral* OOM (:func:`collateral_evidence`) is the other case: the job did not fill its share, but a
neighbour on its GPU was over its own cap when the job failed. The node agent, which saw the neighbour
over, wrote ``collateral: {by, gpu, at}`` into the job's record (AdminComment, and its run record); the
job is then re-run on its own share, the first time at no cost to its user (gpushare.epilog.recovery), unless
:func:`own_overrun` shows the job was over its own cap as well: an offender is never a victim.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from gpushare.config import Config
from gpushare.epilog.learn import failed_size_bytes
from gpushare.epilog.records import RecordLedger
from gpushare.gpus import GiB, find_mig_profile
from gpushare.slurm.gres_request import GresRequest


def measured_peak_bytes(record: dict[str, Any] | None, records_dir: str, job_id: str, restarts: int) -> int | None:
    """The largest device memory gpushare measured for this run of the job; None when nobody measured it."""
    peaks: list[int] = []
    run = (record or {}).get("run")
    if isinstance(run, dict) and isinstance(run.get("peak_gib"), (int, float)) and not isinstance(
            run.get("peak_gib"), bool):
        peaks.append(int(float(run["peak_gib"]) * GiB))
    directory = Path(records_dir)
    if _trusted_dir(records_dir):
        try:
            for entry in RecordLedger(directory).get(job_id, restarts):
                for gpu in (entry.get("gpus") or {}).values():
                    value = gpu.get("peak_bytes") if isinstance(gpu, dict) else None
                    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                        peaks.append(value)
        except (OSError, ValueError):
            pass
    return max(peaks) if peaks else None


def collateral_evidence(record: dict[str, Any] | None, records_dir: str, job_id: str, restarts: int,
                        ended_at: float, window_s: float) -> dict[str, Any] | None:
    """The agent's note that a neighbour was over its cap on this job's GPU, when the job ended within
    ``window_s`` after the agent first saw it (and not before it, less a few seconds of clock skew
    between node and controller); None otherwise. Only root writes either place it is read from."""
    found: list[Any] = [(record or {}).get("collateral")]
    if _trusted_dir(records_dir):
        try:
            found += [entry.get("collateral") for entry in RecordLedger(Path(records_dir)).get(job_id, restarts)]
        except (OSError, ValueError):
            pass
    for note in found:
        if not isinstance(note, dict) or not isinstance(note.get("by"), str):
            continue
        at = note.get("at")
        if isinstance(at, (int, float)) and not isinstance(at, bool) and at - 5.0 <= ended_at <= at + window_s:
            return note
    return None


def own_overrun(record: dict[str, Any] | None, records_dir: str, job_id: str, restarts: int,
                request: GresRequest, cfg: Config) -> str | None:
    """What shows that this run of the job was itself over its GPU memory cap, from records only root writes:
    the node agent's backstop acted on it (``run.stop``, or an ``oom`` entry in its run record), or its
    measured peak exceeded its cap (``run.cap_gib`` / the run record's ``caps.mem_limit_mib``; its share when
    neither is known) by more than the backstop's tolerance, the agent's own test for an offender. None when
    nothing shows it.

    Why: two jobs over their caps on one GPU are each marked as the other's victim; a job over its own cap is
    an offender, never collateral (gpushare.epilog.recovery)."""
    run = (record or {}).get("run")
    run = run if isinstance(run, dict) else {}
    if run.get("stop") == "agent-backstop":
        return "the node agent's backstop acted on it"
    caps: list[int] = []
    cap_gib = run.get("cap_gib")
    if isinstance(cap_gib, (int, float)) and not isinstance(cap_gib, bool) and cap_gib > 0:
        caps.append(int(cap_gib * GiB))
    if _trusted_dir(records_dir):
        try:
            for entry in RecordLedger(Path(records_dir)).get(job_id, restarts):
                oom = entry.get("oom")
                if isinstance(oom, dict) and oom.get("source") == "agent-backstop":
                    return "the node agent's backstop acted on it"
                limit = (entry.get("caps") or {}).get("mem_limit_mib") if isinstance(entry.get("caps"), dict) else None
                if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
                    caps.append(limit << 20)
        except (OSError, ValueError):
            pass
    cap = min(caps) if caps else failed_size_bytes(request, cfg)
    peak = measured_peak_bytes(record, records_dir, job_id, restarts)
    tolerance = cfg.agent.backstop_tolerance_mib << 20
    if cap and peak is not None and peak > cap + tolerance:
        return f"its measured GPU memory peaked at {peak / GiB:.1f} GiB, over its {cap / GiB:.1f} GiB cap"
    return None


def _trusted_dir(path: str) -> bool:
    """A records directory only root (or we) could have written: ours, not group- or world-writable."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid in (0, os.geteuid()) and not info.st_mode & 0o002


def _is_mig(request: GresRequest, cfg: Config) -> bool:
    return any(find_mig_profile(cfg.gpus.values(), item.type) for item in request.named("gpu"))


def corroborate(cfg: Config, record: dict[str, Any] | None, request: GresRequest, job_id: str,
                restarts: int) -> tuple[bool, str]:
    """(True, evidence) when the OOM is backed by our own records, else (False, what is missing)."""
    if cfg.oom.corroborate == "no":
        return True, "not checked ([oom] corroborate = no)"
    if not _is_mig(request, cfg) and (record or {}).get("decision") != "shared":
        return False, "its GPU share was not sized by gpushare (no 'shared' decision in its record)"
    share = failed_size_bytes(request, cfg)
    if not share:
        return False, f"the size of its GPU share ({request.text[:60]!r}) is unknown"
    peak = measured_peak_bytes(record, cfg.agent.records_dir, job_id, restarts)
    if peak is None:
        return False, "no measurement of its GPU memory (node agent) backs the message"
    need = cfg.oom.corroborate_fraction * share
    if peak < need:
        return False, (f"its measured GPU memory peaked at {peak / GiB:.1f} GiB, below "
                       f"{cfg.oom.corroborate_fraction:.0%} of its {share / GiB:.1f} GiB share")
    return True, f"measured peak {peak / GiB:.1f} GiB of a {share / GiB:.1f} GiB share"
