"""``gpushare report``: per-job and per-GPU summaries from the node's records ledger, with PNG plots.

Why from the ledger and not from Slurm: AdminComment can only be updated while a job runs (22.05), so
energy, peak memory and exit status exist in full only in the records the Epilog writes
(``gpushare.epilog.records``). Run it on the GPU node (or on a copy of its records directory).

``--since`` takes a duration back from now (``90m``, ``12h``, ``7d``) or an ISO date/time (UTC).
``--plot DIR`` writes ``job-<id>.<restarts>.png`` (GPU memory, the job's own memory and SMACT over time,
per GPU) and ``energy.png`` (whole-device and attributed energy per job).
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: float | None = None) -> float:
    """Unix time from ``90m``/``12h``/``7d`` (back from now) or an ISO date/time (UTC when naive)."""
    now = time.time() if now is None else now
    match = _DURATION_RE.match(text.strip())
    if match:
        return now - float(match.group(1)) * _UNITS[match.group(2)]
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: use a duration like 12h or 7d, or an ISO date like 2026-11-22") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def _sum(record: dict[str, Any], key: str) -> float | None:
    values = [g.get(key) for g in (record.get("gpus") or {}).values() if g.get(key) is not None]
    return sum(values) if values else None


def job_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary row per job run (pure)."""
    rows = []
    for r in records:
        peaks = [g["peak_bytes"] for g in (r.get("gpus") or {}).values() if g.get("peak_bytes") is not None]
        rows.append({"job": r.get("job"), "restarts": r.get("restarts", 0), "node": r.get("node"),
                     "user": r.get("user"),
                     "gpus": sorted((r.get("gpus") or {}), key=int), "caps": (r.get("caps") or {}).get("mode"),
                     "est_gib": r.get("est_gib"), "duration_s": r.get("duration_s"), "ttfk_s": r.get("ttfk_s"),
                     "energy_j": _sum(r, "energy_j"), "share_j": _sum(r, "share_j"),
                     "peak_gib": round(max(peaks) / 2**30, 2) if peaks else None, "exit_code": r.get("exit_code"),
                     "end": r.get("end")})
    return rows


def gpu_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (node, GPU): jobs, busy seconds, attributed energy, mean TTFK (pure)."""
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        for gpu, g in (r.get("gpus") or {}).items():
            row = table.setdefault((str(r.get("node")), gpu), {"node": r.get("node"), "gpu": int(gpu), "jobs": 0,
                                                                "active_s": 0.0, "share_j": 0.0, "ttfk": []})
            row["jobs"] += 1
            row["active_s"] += g.get("active_s") or 0.0
            row["share_j"] += g.get("share_j") or 0.0
            if r.get("ttfk_s") is not None:
                row["ttfk"].append(r["ttfk_s"])
    out = []
    for row in sorted(table.values(), key=lambda x: (str(x["node"]), x["gpu"])):
        ttfk = row.pop("ttfk")
        row["mean_ttfk_s"] = round(sum(ttfk) / len(ttfk), 2) if ttfk else None
        row["active_s"], row["share_j"] = round(row["active_s"], 1), round(row["share_j"], 1)
        out.append(row)
    return out


def _fmt(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def render(jobs: list[dict[str, Any]], gpus: list[dict[str, Any]]) -> str:
    lines = [f"{'job':>12} {'node':<8} {'gpus':<5} {'caps':<8} {'est GiB':>7} {'peak GiB':>8} {'TTFK s':>7} "
             f"{'run s':>7} {'energy J':>9} {'share J':>9} exit"]
    for j in jobs:
        name = f"{j['job']}" + (f".{j['restarts']}" if j["restarts"] else "")
        lines.append(f"{name:>12} {str(j['node']):<8} {','.join(j['gpus']):<5} {str(j['caps']):<8} "
                     f"{_fmt(j['est_gib']):>7} {_fmt(j['peak_gib'], 2):>8} {_fmt(j['ttfk_s']):>7} "
                     f"{_fmt(j['duration_s']):>7} {_fmt(j['energy_j']):>9} {_fmt(j['share_j']):>9} "
                     f"{_fmt(j['exit_code'])}")
    lines += ["", f"{'node':<8} {'gpu':>3} {'jobs':>5} {'busy s':>8} {'share J':>10} {'mean TTFK s':>11}"]
    for g in gpus:
        lines.append(f"{str(g['node']):<8} {g['gpu']:>3} {g['jobs']:>5} {g['active_s']:>8.1f} {g['share_j']:>10.1f} "
                     f"{_fmt(g['mean_ttfk_s'], 2):>11}")
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], directory: Path) -> list[Path]:
    """PNG files: one timeline per job run, and an energy bar chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for r in records:
        series = r.get("series") or {}
        if not series:
            continue
        fig, axes = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
        for gpu, points in sorted(series.items()):
            if not points:
                continue
            t0 = float(r.get("start") or points[0][0])
            ts = [p[0] - t0 for p in points]
            axes[0].plot(ts, [p[1] / 2**30 for p in points], label=f"GPU {gpu} total")
            axes[0].plot(ts, [p[2] / 2**30 for p in points], "--", label=f"GPU {gpu} this job")
            axes[1].plot(ts, [p[3] for p in points], label=f"GPU {gpu}")
        if r.get("ttfk_s") is not None:
            for ax in axes:
                ax.axvline(r["ttfk_s"], color="grey", linestyle=":", label="first kernel")
        axes[0].set_ylabel("memory (GiB)")
        axes[1].set_ylabel("SMACT")
        axes[1].set_xlabel("seconds since Prolog")
        axes[0].legend(fontsize=7)
        axes[0].set_title(f"job {r.get('job')} on {r.get('node')}")
        path = directory / f"job-{r.get('job')}.{r.get('restarts', 0)}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    rows = job_rows(records)
    if rows:
        fig, ax = plt.subplots(figsize=(max(5, 0.5 * len(rows)), 4))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["energy_j"] or 0 for r in rows], 0.4, label="whole device")
        ax.bar([x + 0.2 for x in xs], [r["share_j"] or 0 for r in rows], 0.4, label="attributed to job")
        ax.set_xticks(list(xs), [str(r["job"]) for r in rows], rotation=45, fontsize=7)
        ax.set_ylabel("energy (J)")
        ax.legend()
        fig.tight_layout()
        path = directory / "energy.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


@click.command()
@click.option("--config", "config_path", envvar="GPUSHARE_CONFIG", help="gpushare.toml to read.")
@click.option("--records", "records_dir", type=click.Path(file_okay=False), help="Records directory "
              "(default: [agent] records_dir).")
@click.option("--job", "job_id", help="Only this job id.")
@click.option("--since", help="Only records ending after this: 12h, 7d, or an ISO date.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: jobs, gpus (and full records with --job).")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), help="Write PNG plots into this directory.")
def command(config_path: str | None, records_dir: str | None, job_id: str | None, since: str | None,
            as_json: bool, plot_dir: str | None) -> int:
    """Per-job TTFK, energy and peak memory, and per-GPU totals, from this node's records."""
    from gpushare.epilog.records import RecordLedger
    from gpushare.config import ConfigError, load_config

    if records_dir is None:
        try:
            records_dir = load_config(config_path).agent.records_dir
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None
    ledger = RecordLedger(records_dir)
    try:
        records = ledger.get(job_id) if job_id else list(ledger.all(parse_since(since) if since else None))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--job") from None
    if since and job_id:
        cutoff = parse_since(since)
        records = [r for r in records if float(r.get("end") or 0) >= cutoff]
    if not records:
        click.echo(f"no records{' for job ' + job_id if job_id else ''} in {records_dir}", err=True)
        return 1
    jobs, gpus = job_rows(records), gpu_rows(records)
    if as_json:
        out: dict[str, Any] = {"jobs": jobs, "gpus": gpus}
        if job_id:
            out["records"] = records
        click.echo(json.dumps(out, indent=2, default=str))
    else:
        click.echo(render(jobs, gpus))
    if plot_dir:
        for path in plot(records, Path(plot_dir)):
            click.echo(f"wrote {path}", err=True)
    return 0
