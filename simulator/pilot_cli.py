"""``gpushare pilot report``: what gpushare would have done on this cluster's jobs (observe mode), from Slurm only.

Runs on the controller or a login host: no GPU, no root beyond what ``sacct`` needs to read every user's jobs
(an operator or ``PrivateData`` off). The gather part is here: one ``sacct`` call over the period
(``--since 7d``, ``--partition``, ``--account``) or a saved export of it (``--from``), each row with our
record (gpushare.slurm.record.stored: SystemComment under AdminComment); the what-if replays the same jobs
through ``--policy live`` with this site's configuration over several seeds and every utilisation model the
simulator ships. Compute: gpushare.simulator.pilot_report; render: gpushare.simulator.pilot_render. docs/agent.md, *Pilot report*.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

from gpushare.simulator.pilot_report import Job, build, tres
from gpushare.slurm import record as record_format
from gpushare.cli_params import since_time

FIELDS = ("JobIDRaw", "JobName", "User", "Account", "Partition", "State", "Submit", "Start", "End", "AllocTRES",
          "SystemComment", "AdminComment")
SEP = "\x1f"  # as gpushare.slurm.accounting: both comments are free text
UTILS = ("carma-fit", "classes")


def _time(text: str) -> float | None:
    if text in ("", "Unknown", "None"):
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    return (moment if moment.tzinfo else moment.astimezone()).timestamp()


def rows_to_jobs(text: str) -> list[Job]:
    """``sacct -n -P --delimiter=\\x1f -X -o FIELDS`` output -> the period's GPU jobs (pure)."""
    jobs = []
    for line in text.splitlines():
        parts = line.split(SEP, len(FIELDS) - 1)
        if len(parts) != len(FIELDS):
            continue
        row = dict(zip(FIELDS, parts))
        gpus, shards, gpu_type = tres(row["AllocTRES"])
        record = record_format.stored(row["AdminComment"], row["SystemComment"]) or {}
        if not gpus and not shards and not record:
            continue  # not a GPU job (or one that never got its GPUs and has no record of ours)
        jobs.append(Job(job_id=row["JobIDRaw"], name=row["JobName"], user=row["User"], account=row["Account"],
                        partition=row["Partition"], state=row["State"].split(" ")[0], submit=_time(row["Submit"]),
                        start=_time(row["Start"]), end=_time(row["End"]), gpus=gpus, shards=shards,
                        gpu_type=gpu_type, record=record))
    return jobs


def sacct_args(start: datetime, end: datetime, partition: str | None, account: str | None) -> list[str]:
    args = ["sacct", "-n", "-P", f"--delimiter={SEP}", "-X", "-a", "-S", start.strftime("%Y-%m-%dT%H:%M:%S"),
            "-E", end.strftime("%Y-%m-%dT%H:%M:%S"), "-o", ",".join(FIELDS)]
    if partition:
        args += ["-r", partition]
    if account:
        args += ["-A", account]
    return args


def trace_of(jobs: list[Job], mem_gib: float = 8.0) -> str:
    """The jobs that ran as a simulator trace (rich CSV, gpushare.simulator.trace): arrival, GPUs, run time,
    the measured peak (else the would-be cap, else ``mem_gib``)."""
    ran = [j for j in jobs if j.submit is not None and j.start is not None and j.end is not None]
    if not ran:
        return ""
    origin = min(j.submit for j in ran if j.submit is not None)
    out = ["job_id,submit_s,gpus,duration_s,mem_gib,util"]
    for job in sorted(ran, key=lambda j: (j.submit or 0, j.job_id)):
        peak = job.run.get("peak_gib")
        mem = float(peak) if isinstance(peak, (int, float)) and peak > 0 else (
            float(job.shards) if job.shards and not job.gpus else mem_gib)
        out.append(f"{job.job_id},{(job.submit or 0) - origin:.0f},{max(job.gpus, 1)},{max(job.elapsed_s, 1.0):.0f},"
                   f"{mem:g},medium")
    return "\n".join(out) + "\n"


def what_if(jobs: list[Job], config_file: str | None, release: str, nodes: int, gpus_per_node: int, gpu: str,
            seeds: list[int]) -> tuple[list[dict[str, Any]], list[float]]:
    """Each (seed, utilisation model): the jobs through ``--policy live`` with the site's configuration; the
    summaries and the first run's per-job waits."""
    from gpushare.config import load_config
    from gpushare.simulator import report, trace
    from gpushare.simulator.cli import THROUGHPUTS_NAME, data_dir
    from gpushare.simulator.engine import SimConfig
    from gpushare.simulator.live import setup
    from gpushare.simulator.runner import simulation

    text = trace_of(jobs)
    if not text:
        return [], []
    live = setup(load_config(config_file), release)
    keys = ("wait_mean_s", "wait_p95_s", "jct_mean_s", "jct_p95_s")
    common: dict[str, Any] = {"nodes": nodes, "gpus_per_node": gpus_per_node, "gpu": gpu,
                              "throughputs": data_dir(None) / THROUGHPUTS_NAME}
    runs: list[dict[str, Any]] = []
    waits: list[float] = []
    for util in UTILS:
        for seed in seeds:
            jobs_ = trace.parse(text, "pilot", seed)
            base = report.summarise(simulation(jobs_, SimConfig(policy="exclusive", estimator="none", seed=seed,
                                                                util=util, **common)).run())
            config = SimConfig(policy="live", estimator="measured", seed=seed, caps=live.caps, recovery=live.recovery,
                               live=live, util=util, **common)
            sim = simulation(jobs_, config).run()
            summary = report.summarise(sim)
            runs.append({"util": util, "seed": seed, **{k: summary[k] for k in keys},
                         # the same simulated cluster with every job on whole GPUs: live's change against it
                         **{f"exclusive_{k}": base[k] for k in keys}})
            if not waits:
                waits = [r["wait_s"] for r in report.job_records(sim) if r["wait_s"] is not None]
    return runs, waits


@click.group("pilot")
def command() -> None:
    """Observe mode's pilot: what gpushare would have done on this cluster's jobs."""


@command.command("report")
@click.option("--since", default="7d", show_default=True, help="period start: 7d, 12h, 30m or an ISO date")
@click.option("--partition", default=None, help="only these partitions (comma-separated, as sacct -r)")
@click.option("--account", default=None, help="only these accounts (comma-separated, as sacct -A)")
@click.option("--from", "from_file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="a saved export instead of sacct: sacct -n -P --delimiter=$'\\x1f' -X -a -o " + ",".join(FIELDS))
@click.option("--json", "as_json", is_flag=True, help="print the versioned JSON document")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None,
              help="also write a self-contained HTML page with plots here")
@click.option("--what-if/--no-what-if", "run_whatif", default=True, show_default=True,
              help="replay the jobs through --policy live (seeds x utilisation models)")
@click.option("--seeds", type=click.IntRange(1, 20), default=3, show_default=True, help="what-if seeds 0..N-1")
@click.option("--config", "config_file", default=None, help="gpushare.toml for the what-if (default: as gpushare simulate)")
@click.option("--slurm", "release", default="22.05", show_default=True, help="the what-if's Slurm release")
@click.option("--nodes", type=click.IntRange(1), default=None, help="what-if GPU nodes (default: enough for the "
              "most GPUs the period's jobs held at once)")
@click.option("--gpus-per-node", type=click.IntRange(1), default=8, show_default=True)
@click.option("--gpu", default="a100-80gb", show_default=True, help="the what-if's GPU model")
def report_command(since: str, partition: str | None, account: str | None, from_file: str | None, as_json: bool,
                   html_path: str | None, run_whatif: bool, seeds: int, config_file: str | None, release: str,
                   nodes: int | None, gpus_per_node: int, gpu: str) -> None:
    """Coverage, would-be sharing, safety and a what-if for the period, with one line of advice per finding."""
    from gpushare.simulator.pilot_render import to_html, to_json, to_text

    now = datetime.now(timezone.utc).astimezone()
    start = now if from_file else since_time(since, now)  # an export holds its own period
    if from_file:
        text = Path(from_file).read_text()
    else:
        from gpushare.slurm.client import SlurmClient, SlurmError

        try:
            text = SlurmClient().run(*sacct_args(start, now, partition, account))
        except SlurmError as exc:
            raise click.ClickException(f"sacct: {exc}") from None
    jobs = rows_to_jobs(text)
    if from_file:  # the export's own filter; --partition/--account still apply
        jobs = [j for j in jobs if (not partition or j.partition in partition.split(","))
                and (not account or j.account in account.split(","))]
    runs: list[dict[str, Any]] = []
    waits: list[float] = []
    if run_whatif and jobs:
        runs, waits = what_if(jobs, config_file, release, nodes or _nodes(jobs, gpus_per_node), gpus_per_node, gpu,
                              list(range(seeds)))
    period = {"since": Path(from_file).name if from_file else start.isoformat(timespec="seconds"),
              "until": "end of export" if from_file else now.isoformat(timespec="seconds"),
              "partition": partition, "account": account}
    doc = build(jobs, runs, period, waits)
    if html_path:
        Path(html_path).write_text(to_html(doc))
    click.echo(to_json(doc) if as_json else to_text(doc).rstrip("\n"))
    if html_path and not as_json:
        click.echo(f"wrote {html_path}")


def _nodes(jobs: list[Job], gpus_per_node: int) -> int:
    """Nodes enough for the most GPUs the jobs held at once (a lower bound on the cluster)."""
    events = sorted([(j.start, max(j.gpus, 1)) for j in jobs if j.start is not None and j.end is not None]
                    + [(j.end, -max(j.gpus, 1)) for j in jobs if j.start is not None and j.end is not None])
    held = peak = 0
    for _, delta in events:
        held += delta
        peak = max(peak, held)
    return max(1, -(-peak // gpus_per_node))
