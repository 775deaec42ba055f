"""OOM recovery's gather: one ended run of a job, read once into the evidence record its decision judges.

Recovery is gather → decide → act (gpushare.policy.oom_recovery). Everything here is reading: the job's log
tails as the job's user (gpushare.user_files), the TaskEpilog's report in the job's Comment, the node agent's
run records of this run (only from a folder only root could have written), the ledger's counts, the GPU types
the cluster's nodes offer and the Slurm release. :func:`gather` puts it all into one
:class:`~gpushare.policy.oom_recovery.OomEvidence`; nothing here decides.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path
from typing import Any, Mapping

from gpushare.config import Config
from gpushare.epilog import task_epilog
from gpushare.epilog.ledger import Ledger
from gpushare.epilog.oom_detect import classify, compile_patterns
from gpushare.epilog.records import RecordLedger
from gpushare.policy.oom_recovery import JobFacts, OomEvidence, OomVerdict
from gpushare.slurm.client import SlurmClient, SlurmError
from gpushare.slurm.nodes import offered_gpu_types
from gpushare.user_files import read_tail

log = logging.getLogger("gpushare.epilog")


def gather(job: JobFacts, env: Mapping[str, str], client: SlurmClient, cfg: Config, ledger: Ledger,
           early: OomVerdict | None = None) -> OomEvidence:
    """The evidence of ``job``'s ended run. ``early``: the verdict the hook's prefilter already reached on the
    logs the environment names, used when Slurm's record names the same files."""
    verdict = early if early is not None and _same_paths(early, job) else detect(job, cfg)
    verdict = reported_from_node(job, verdict)
    for problem in verdict.problems:
        log.warning("job %s: %s", job.job_id, problem)
    return OomEvidence(
        job=job, verdict=verdict,
        run_records=run_records(cfg.agent.records_dir, job.job_id, job.restarts),
        retries_used=ledger.retries_used(job.job_id), free_reruns=ledger.free_reruns(job.job_id),
        user_recoveries=ledger.user_recoveries(job.uid),
        mig_available=mig_types(client) if job.gres.named("gpu") else None,
        whole_gpu_as_gpu=_gres_across_names(client), ended_at=_ended_at(env))


def detect(job: JobFacts, cfg: Config) -> OomVerdict:
    """Read each log tail as the job's user and classify; unreadable logs are noted, never fatal."""
    if job.exit_code == 0 and job.exit_signal == 0:
        return classify([], 0, 0, ())
    tails: list[tuple[str, str | None]] = []  # (path, tail; None: unreadable)
    problems: list[str] = []
    for path in job.log_paths:
        try:
            tails.append((path, read_tail(path, cfg.oom.tail_bytes, job.uid, job.gid, cfg.oom.read_timeout_s)))
        except OSError as exc:  # TailError, or an I/O error of the file system itself
            problems.append(str(exc))
            tails.append((path, None))
    return classify(tails, job.exit_code, job.exit_signal, compile_patterns(cfg.oom.patterns_extra),
                    tuple(problems))


def reported_from_node(job: JobFacts, verdict: OomVerdict) -> OomVerdict:
    """``verdict``, or the OOM message the job's TaskEpilog read on the node and put in its Comment
    (gpushare.epilog.task_epilog), for this run, when the logs here showed none."""
    report = task_epilog.parse(job.comment)
    if verdict.is_oom or report is None or report["restarts"] != job.restarts:
        return verdict
    return OomVerdict(True, f"GPU out of memory ({report['family']}) in {report['source']} on {job.node or 'its node'}, "
                            "reported by the job's TaskEpilog", report["family"], report["line"],
                      f"{job.node}:{report['source']}", verdict.problems)


def run_records(records_dir: str, job_id: str, restarts: int) -> tuple[dict[str, Any], ...]:
    """The node agent's records of this run of the job (one per node), when the controller can read them from
    a folder only root (or we) could have written; none otherwise."""
    if not _trusted_dir(records_dir):
        return ()
    try:
        return tuple(RecordLedger(Path(records_dir)).get(job_id, restarts))
    except (OSError, ValueError):
        return ()


def _trusted_dir(path: str) -> bool:
    """A records directory only root (or we) could have written: ours, not group- or world-writable."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid in (0, os.geteuid()) and not info.st_mode & 0o002


def mig_types(client: SlurmClient) -> set[str] | None:
    """GPU types the cluster's nodes offer (``sinfo %G``); None when Slurm cannot tell us."""
    try:
        return offered_gpu_types(client)
    except (SlurmError, OSError) as exc:
        log.warning("cannot list GRES types (%s); any larger MIG profile is allowed", exc)
        return None


def _gres_across_names(client: SlurmClient) -> bool:
    """Whether this Slurm lets a held job change ``shard`` → ``gpu`` (24.11+); False when unknown."""
    try:
        return client.version.held_gres_across_names
    except (SlurmError, OSError, ValueError, AttributeError) as exc:
        log.info("Slurm release unknown (%s): the exclusive retry asks for all shards of a GPU", exc)
        return False


def _ended_at(env: Mapping[str, str]) -> float:
    """When the job ended: slurmctld's SLURM_JOB_END_TIME (26.05 sets it; measured), else now (the hook
    runs as the job ends)."""
    value = env.get("SLURM_JOB_END_TIME", "")
    return float(value) if value.isdigit() else time.time()


def _same_paths(verdict: OomVerdict, job: JobFacts) -> bool:
    """The early verdict read the same files Slurm's record names (else read them again)."""
    return verdict.source is None or verdict.source in job.log_paths
