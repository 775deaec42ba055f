"""``gpushare estimates``: jobs waiting for their asynchronous estimate, and what recent ones got.

Everything comes from ``squeue --json`` (the held jobs' records and the ``gpushare-estimate-<job>`` jobs),
so users and admins see the same thing Slurm holds, with no state of our own to drift. Finished jobs
appear for as long as slurmctld remembers them (``MinJobAge``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import click

from gpushare.slurm.record import parse as parse_record
from gpushare.slurm_plugins.estimation_plan import ESTIMATION_JOB_PREFIX
from gpushare.slurm.client import SlurmClient, SlurmError
from gpushare.slurm.jobs import Job


def collect(jobs: list[Job], now: float, user: str | None = None) -> list[dict[str, Any]]:
    """One row per GPU job that went through asynchronous estimation (pure, for tests)."""
    estimations = {j.job_id: j for j in jobs if j.name.startswith(ESTIMATION_JOB_PREFIX)}
    rows = []
    for job in jobs:
        record = parse_record(job.admin_comment)
        if not record or not (record.get("decision") == "estimating" or "est_job" in record):
            continue
        if user and job.user_name != user:
            continue
        est = estimations.get(str(record.get("est_job"))) if isinstance(record.get("est_job"), int) else None
        waiting = record.get("decision") == "estimating"
        rows.append({
            "job": int(job.job_id), "user": job.user_name or "?", "state": job.state or "?",
            "phase": ("estimating" if est is not None else "queued") if waiting else "released",
            "held_s": round(now - (job.submit_time or now), 1) if waiting else record.get("held_s"),
            "est_job": record.get("est_job"), "est_state": est.state if est else None,
            "result": record.get("new") if not waiting else None,
            "decision": record.get("decision"), "why": record.get("why", ""), "script": record.get("script", ""),
        })
    return sorted(rows, key=lambda r: (r["phase"] == "released", r["job"]))


def render(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no jobs waiting for or recently released from asynchronous estimation"
    lines = [f"{'JOB':>8} {'USER':<12} {'PHASE':<10} {'HELD':>7} {'EST.JOB':>8} {'EST.STATE':<10} RESULT / SCRIPT"]
    for row in rows:
        held = f"{row['held_s']:.0f}s" if isinstance(row["held_s"], (int, float)) else "-"
        if row["phase"] == "released":
            tail = f"{row['result']} ({row['decision']}: {row['why'][:70]})"
        else:
            tail = row["script"][:90]
        lines.append(f"{row['job']:>8} {str(row['user'])[:12]:<12} {row['phase']:<10} {held:>7} "
                     f"{row['est_job'] or '-':>8} {row['est_state'] or '-':<10} {tail}")
    return "\n".join(lines)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@click.option("--user", "-u", help="Only this user's jobs.")
@click.option("--release-overdue", is_flag=True,
              help="As root: release jobs held longer than [estimation] watchdog_s with the fallback, as "
                   "gpushare-submitd's watchdog does (for when the service is down; a timer runs it).")
@click.option("--config", "config_path", envvar="GPUSHARE_CONFIG", help="gpushare.toml (with --release-overdue).")
def command(as_json: bool, user: str | None, release_overdue: bool, config_path: str | None) -> int:
    """List jobs held for asynchronous GPU memory estimation and recently released ones."""
    if release_overdue:
        return _release_overdue(config_path)
    try:
        jobs = SlurmClient().jobs()
    except SlurmError as exc:
        raise click.ClickException(f"cannot read the queue: {exc}") from None
    rows = collect(jobs, time.time(), user)
    click.echo(json.dumps(rows, indent=2) if as_json else render(rows))
    return 0


def _release_overdue(config_path: str | None) -> int:
    from gpushare.config import ConfigError, load_config
    from gpushare.logs import setup_logging
    from gpushare.slurm_plugins.estimation_plan import Release
    from gpushare.slurm_plugins.estimationd import EstimationService

    if os.geteuid() != 0:
        raise click.ClickException("--release-overdue updates other users' jobs: run it as root")
    try:
        cfg = load_config(config_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    setup_logging("gpushare-estimates", cfg.submit.log_file, "INFO")
    try:
        actions = EstimationService(cfg).release_overdue()
    except SlurmError as exc:
        raise click.ClickException(f"cannot read the queue: {exc}") from None
    released = [a.job_id for a in actions if isinstance(a, Release)]
    click.echo(f"released {len(released)} overdue job(s){': ' + ' '.join(map(str, released)) if released else ''}")
    return 0
