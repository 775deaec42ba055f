"""A job's run summary in its AdminComment, next to the submit decision (``gpushare:{…}``).

Why two writers: Slurm 22.05 accepts ``scontrol update admincomment=`` only while a job is pending or
running — measured here, the slurmd Epilog already gets "Job has already finished" while the job is
COMPLETING. So the agent writes the run summary as soon as it knows the TTFK (the job is running), and
the Epilog tries once more with energy, peak memory and exit status; when Slurm refuses, the full record
is in the node's ledger (``gpushare report``). A foreign admin comment (not ``gpushare:``) is never
overwritten, and the result stays within the submit record's length limit.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from gpushare.slurm import record as record_format
from gpushare.slurm.admin_comment import merge_write

if TYPE_CHECKING:
    from gpushare.slurm.client import SlurmClient
    from gpushare.slurm.jobs import Job

log = logging.getLogger("gpushare.agent")


def run_summary(record: dict[str, Any]) -> dict[str, Any]:
    """The compact part of a record that goes into AdminComment (``run`` key of the gpushare record).

    Besides the totals: ``ttfk_src`` (how the first kernel was seen), ``cap_gib`` (the memory cap the job ran
    under), ``stop`` (the agent stopped or requeued it: backstop or forecast) and ``gpus`` {index: [peak GiB,
    mean SMACT %]} for at most ``MAX_GPUS`` GPUs, so ``gpushare jobstats`` can advise from Slurm alone."""
    gpus = record.get("gpus") or {}
    energy = [g["energy_j"] for g in gpus.values() if g.get("energy_j") is not None]
    share = [g["share_j"] for g in gpus.values() if g.get("share_j") is not None]
    peaks = [g["peak_bytes"] for g in gpus.values() if g.get("peak_bytes") is not None]
    caps = record.get("caps") or {}
    stopped = record.get("oom") or record.get("forecast")
    summary = {"node": record.get("node"), "ttfk_s": record.get("ttfk_s"), "ttfk_src": record.get("ttfk_source"),
               "energy_j": round(sum(energy), 1) if energy else None,
               "share_j": round(sum(share), 1) if share else None,
               "peak_gib": round(max(peaks) / 2**30, 2) if peaks else None,
               "exit": record.get("exit_code"), "caps": caps.get("mode"),
               "cap_gib": round(caps["mem_limit_mib"] / 1024, 2) if caps.get("mem_limit_mib") else None,
               "stop": stopped.get("source") if isinstance(stopped, dict) else None,
               "would": record.get("would") or None,  # observe mode: the cap and stop never applied
               "gpus": _per_gpu(gpus, record.get("series") or {}) or None}
    return {k: v for k, v in summary.items() if v is not None}


MAX_GPUS = 8  # per-GPU detail beyond this many GPUs would crowd out the rest of the record


def _per_gpu(gpus: dict[str, Any], series: dict[str, Any]) -> dict[str, list[float | None]]:
    out: dict[str, list[float | None]] = {}
    for index in sorted(gpus, key=lambda g: int(g) if str(g).isdigit() else 0)[:MAX_GPUS]:
        peak = gpus[index].get("peak_bytes")
        samples = [p[3] for p in series.get(index) or [] if isinstance(p, list) and len(p) > 3
                   and isinstance(p[3], (int, float))]
        out[str(index)] = [round(peak / 2**30, 2) if isinstance(peak, (int, float)) else None,
                           round(100.0 * sum(samples) / len(samples), 1) if samples else None]
    return out


def merged_comment(existing: str | None, **fields: Any) -> str | None:
    """``existing`` with ``fields`` merged in; None for someone else's comment. The run summary is merged key
    by key: the agent writes it in parts while the job runs (TTFK first, the peak when it becomes OOM
    evidence), so a later part never drops an earlier one."""
    if isinstance(fields.get("run"), dict):
        before = (record_format.parse(existing) or {}).get("run") if existing else None
        fields["run"] = {**(before if isinstance(before, dict) else {}), **fields["run"]}
    return record_format.merge(existing, **fields)


def annotate(client: SlurmClient, job: str, record: dict[str, Any], slurm_job: Job | None = None) -> bool:
    """Write ``record``'s run summary into the job's AdminComment; True when Slurm took it."""
    return annotate_fields(client, job, slurm_job, run=run_summary(record))


def annotate_fields(client: SlurmClient, job: str, slurm_job: Job | None = None, **fields: Any) -> bool:
    """Merge ``fields`` into the job's gpushare AdminComment record; True when Slurm took it.

    ``slurm_job`` is no longer read for the comment: a copy read earlier may miss a note written since
    (gpushare/slurm/admin_comment.py reads the comment fresh, merges and verifies)."""
    try:
        taken = merge_write(client, job, lambda existing: merged_comment(existing, **fields))
    except Exception as exc:  # noqa: BLE001 - unreachable, or a finished job refuses updates (22.05)
        log.info("job %s: AdminComment not updated (%s); the record is in the ledger", job,
                 str(getattr(exc, "reason", exc))[:200])
        return False
    if not taken:
        log.info("job %s: AdminComment holds a foreign comment or would overflow; left unchanged", job)
    return taken
