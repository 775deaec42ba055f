"""``gpushare-epilog``: Slurm's node Epilog (root, on the job's node, after the job ends).

It closes the job's record: asks the agent to stop tracking the job (its final first-kernel time,
attributed energy, peak memory and timeline come back), adds the whole-device energy delta from the
counters and the exit status Slurm reports while the job is completing, writes the record to the durable
ledger (``gpushare.epilog.records``) and, where the job still has no foreign admin comment, into its
AdminComment: through ``scontrol update`` (refused once the job is COMPLETING on 22.05; docs/compatibility.md),
and into the accounting database's copy through ``sacctmgr`` (``gpushare.epilog.stored_record``), which
outlives the node. Without the agent it builds the same record from the store entry the Prolog wrote (no TTFK
or share then: nobody watched).

A failing Epilog drains the node (docs/compatibility.md), so this entry point catches everything and exits 0:
our own problems are logged, never turned into a drained node.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from gpushare.gres.device import Number
    from gpushare.slurm.client import SlurmClient
    from gpushare.gres.device import GpuBackend
    from gpushare.config import AgentSection
    from gpushare.slurm.jobs import Job

log = logging.getLogger("gpushare.epilog")


class _NoEnergy:
    """Stands in for a device backend that cannot be opened: every counter reads N/A."""

    def energy_mj(self, index: int) -> Number:
        from gpushare.gres import NA

        return NA


def close_job(env: Mapping[str, str], cfg: AgentSection, client: SlurmClient | None = None,
             backend: GpuBackend | None = None) -> dict[str, Any] | None:
    """Close this Epilog's job; returns the record written (None: not a GPU job we registered)."""
    from gpushare.epilog.records import RecordLedger
    from gpushare.node.comment import annotate
    from gpushare.node.api import call, node_name, socket_path
    from gpushare.node.jobs import final_record
    from gpushare.node.store import JobStore
    from gpushare.node.hook_env import job_from_env
    from gpushare.node.caps import caps_path

    job = job_from_env(env)
    if job is None:
        return None
    if cfg.hardcap != "off":  # off: the Prolog wrote nothing to undo
        from gpushare.node import hardcap

        hardcap.clear(job.job, backend=backend, device_backend=cfg.device_backend or None)
    store = JobStore(Path(cfg.state_dir) / "jobs")
    entry, closed_by = None, "agent"
    try:
        reply = call(socket_path(cfg), {"op": "close", "job": job.job}, timeout_s=10.0)
        entry = reply.get("entry") if reply.get("ok") else None
    except Exception as exc:  # noqa: BLE001 - agent down: the store still has the Prolog's entry
        log.warning("job %s: agent unavailable (%s); closing from the store", job.job, exc)
    if not isinstance(entry, dict):
        entry, closed_by = store.get(job.job), "epilog"
    if entry is None:
        log.warning("job %s: never registered on this node (Prolog not run or failed); no record", job.job)
        return None
    if backend is None:
        try:
            from gpushare.gres import open_backend

            backend = open_backend(cfg.device_backend or None)
        except Exception as exc:  # noqa: BLE001
            log.error("job %s: device backend unavailable (%s); energy left empty", job.job, exc)
    record = final_record(entry, backend if backend is not None else _NoEnergy(), closed_by=closed_by, node=node_name(cfg))
    slurm_job, client = _slurm_job(env, cfg, client, job.job)
    record["exit_code"] = slurm_job.exit_status if slurm_job else None
    record["exit_signal"] = slurm_job.exit_signal if slurm_job else None
    state = slurm_job.state if slurm_job else ""
    record["state"] = state if state.replace("_", "").isalpha() else None
    try:  # a full or broken records disk must not keep the record from Slurm's copies below
        RecordLedger(cfg.records_dir).put(record)
        log.info("job %s: record written (ttfk %s s, energy %s)", job.job, record["ttfk_s"],
                 {g: v.get("energy_j") for g, v in record["gpus"].items()})
    except OSError as exc:  # the atomic write left no partial file behind (gpushare.atomic)
        log.error("job %s: record not written to the node ledger %s (%s); the AdminComment and the accounting "
                  "database still get it", job.job, cfg.records_dir, exc.strerror or exc)
    if cfg.admin_comment == "yes" and slurm_job is not None:
        annotate(client, job.job, record, slurm_job)
    if cfg.admin_comment == "yes" and client is not None:
        _store(client, job.job, record, cfg.state_dir)
    store.delete(job.job)
    caps_path(cfg.run_dir, job.job).unlink(missing_ok=True)
    return record


def _store(client: SlurmClient, job: str, record: dict[str, Any], state_dir: str) -> None:
    """The run summary into Slurm's accounting database (gpushare.epilog.stored_record); never fatal. Within
    a few seconds or not at all: a summary the database does not take now is spooled on this node and
    delivered by the agent's loop or the next Epilog; when this one is stored, older spooled ones follow."""
    from gpushare.epilog.stored_record import (BUDGET_S, with_timeout, deliver, final_summary, permanent,
                                               spool, spool_dir, store_summary)

    started = time.monotonic()
    summary, ended_at = final_summary(record), float(record.get("end") or time.time())
    try:  # its own short timeout: an unreachable slurmdbd must not hold the node for the client's default
        outcome = store_summary(with_timeout(client, BUDGET_S), job, summary, ended_at)
        result = outcome.result
    except Exception as exc:  # noqa: BLE001 - the spool and the node ledger still have the record
        outcome, result = None, str(exc)[-200:]
    if outcome is not None and permanent(outcome):
        log.info("job %s: accounting database: %s (%d reads, %d writes, %.3f s)", job, result, outcome.reads,
                 outcome.writes, time.monotonic() - started)
    else:
        try:
            path = spool(spool_dir(state_dir), job, summary, ended_at)
            log.warning("job %s: record not stored in the accounting database yet (%s); spooled as %s for "
                        "delivery when it is reachable (%.3f s)", job, result, path, time.monotonic() - started)
        except OSError as exc:
            log.error("job %s: record not stored in the accounting database (%s) and not spooled (%s); the node "
                      "ledger keeps it", job, result, exc)
        return
    try:
        left = BUDGET_S + 2.0 - (time.monotonic() - started)
        if left > 0.5:
            delivered, waiting = deliver(with_timeout(client, left), spool_dir(state_dir), budget_s=left)
            if delivered or waiting:
                log.info("spooled records: %d delivered, %d still pending", delivered, waiting)
    except Exception as exc:  # noqa: BLE001 - the agent's loop delivers them later
        log.warning("spooled records not delivered (%s)", str(exc)[-200:])


def _slurm_job(env: Mapping[str, str], cfg: AgentSection, client: SlurmClient | None,
               job: str) -> tuple[Job | None, Any]:
    try:
        if client is None:
            from gpushare.slurm.client import SlurmClient

            client = SlurmClient(env.get("SLURM_CONF") or None)
        return client.job(job), client
    except Exception as exc:  # noqa: BLE001
        log.warning("job %s: Slurm record unavailable (%s); exit status and AdminComment skipped", job, exc)
        return None, client


def main(argv: list[str] | None = None) -> int:
    from gpushare.hooks import run_hook
    from gpushare.slurm.client import SlurmClient

    return run_hook("gpushare-epilog", lambda cfg: close_job(os.environ, cfg.agent, client=SlurmClient.from_config(cfg)),
                    lambda cfg: cfg.agent.log_file, "node stays up")


if __name__ == "__main__":
    sys.exit(main())
