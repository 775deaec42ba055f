"""``gpushare jobstats JOBID [--json]``: what a finished job did on its GPU, with one line of advice.
``gpushare jobstats --format csv|json|xdmod [JOBID...]``: many ended jobs with their GPU fraction, for a site's
reporting (gpushare.epilog.jobstats_export).

Why from Slurm only: users run it on a login node, which holds none of the GPU node's files. The node Epilog
stores the job's run summary in the accounting database (gpushare.epilog.stored_record) next to the submit
decision and any OOM recovery, all in the job's ``gpushare:`` record (SystemComment, and AdminComment where no
site tool overwrote it: gpushare.slurm.record ``stored``); ``sacct`` reads it back. Which
jobs a user may read is Slurm's decision: with ``PrivateData=jobs`` (slurm.conf and slurmdbd.conf) another
user's job is simply not found. Without an accounting database the job is read from slurmctld
(``scontrol``) while it still holds the job (``MinJobAge``).

The ``--json`` document (``v`` 1) is docs/formats.md's "jobstats document".
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import click

from gpushare.estimate.cache import LEARN_FACTOR
from gpushare.gpus import BUILTIN_GPUS, GiB, GpuModel
from gpushare.slurm import record as record_format
from gpushare.epilog.jobstats_export import FIELDS as EXPORT_FIELDS, FORMATS, export, parse_rows
from gpushare.slurm.accounting import SEP, job_rows
from gpushare.cli_params import since_time
from gpushare.slurm.client import SlurmClient, SlurmError
from gpushare.slurm.jobs import check_job_id
from gpushare.slurm.tres import gpu_tres

VERSION = 1
_FIELDS = ("JobIDRaw", "JobID", "User", "State", "ExitCode", "Elapsed", "NodeList", "AllocTRES", "SystemComment",
           "AdminComment")
GENEROUS = 0.7  # a peak below this fraction of the share means the job asked for too much


class NotFound(click.ClickException):
    exit_code = 1


def _elapsed_s(text: str) -> float | None:
    match = re.match(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)(?:\.\d+)?$", text.strip())
    if not match:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def from_sacct(client: SlurmClient, job: str) -> list[dict[str, str]] | None:
    """Every run of ``job`` the caller may read (oldest first); None when there is no accounting database."""
    return job_rows(client, job, _FIELDS)


def from_scontrol(client: SlurmClient, job: str) -> list[dict[str, str]]:
    """The job as slurmctld still holds it (no accounting database)."""
    found = client.job(job)
    if found is None:
        return []
    text = client.show_job_text(job)
    return [{"JobIDRaw": found.job_id, "JobID": job, "User": found.user_name, "State": found.state,
             "ExitCode": f"{found.exit_status or 0}:{found.exit_signal or 0}", "Elapsed": text.get("RunTime", ""),
             "NodeList": text.get("NodeList", ""), "AllocTRES": text.get("AllocTRES", ""),
             "SystemComment": "", "AdminComment": found.admin_comment or ""}]


def summarise(runs: list[dict[str, str]], live: dict[str, Any] | None = None,
              catalogue: Mapping[str, GpuModel] | None = None) -> dict[str, Any]:
    """The jobstats document of a job from its runs (the last one is described; pure). ``live``: the running
    job's summary so far from the agent on its node (``live_summary``), which replaces a stored partial one.
    ``catalogue``: the site's GPU models (``Config.gpus``; default: the built-in ones)."""
    last = runs[-1]
    record = record_format.stored(last.get("AdminComment"), last.get("SystemComment")) or {}
    found = record.get("run")
    run: dict[str, Any] = found if isinstance(found, dict) else {}
    if live is not None:
        run = live
    gres = gpu_tres(last.get("AllocTRES", ""))
    exit_code, _, signal = last.get("ExitCode", "").partition(":")
    gpus = {str(k): {"peak_gib": v[0], "smact_pct": v[1]} for k, v in (run.get("gpus") or {}).items()
            if isinstance(v, list) and len(v) == 2}
    doc: dict[str, Any] = {
        "v": VERSION, "job": last.get("JobID") or last.get("JobIDRaw"), "user": last.get("User") or None,
        "state": (last.get("State") or "").split()[0] or None, "runs": len(runs),
        "exit_code": int(exit_code) if exit_code.isdigit() else None,
        "signal": int(signal) if signal.isdigit() else None,
        "elapsed_s": _elapsed_s(last.get("Elapsed", "")), "node": run.get("node") or last.get("NodeList") or None,
        "gres": _gres_text(gres), "gpu_type": gres.get("type"),
        "decision": record.get("decision"), "est_gib": record.get("est_gib"), "margin_gib": record.get("margin_gib"),
        "share_gib": _share_gib(gres, run, catalogue), "peak_gib": run.get("peak_gib"), "gpus": gpus,
        "ttfk_s": run.get("ttfk_s"), "ttfk_source": run.get("ttfk_src"),
        "energy_j": run.get("energy_j"), "energy_share_j": run.get("share_j"),
        "caps": run.get("caps"), "cap_gib": run.get("cap_gib"), "stopped_by": run.get("stop"),
        "oom": record.get("oom") if isinstance(record.get("oom"), dict) else None,
        # observe mode: the share, cap and backstop stop this job would have had (gpushare.policy.observe)
        "would": _would(record, run),
        "recorded": bool(run),
        # the agent's summary written while the job ran, with no final one yet: the node's Epilog spooled that
        # (the database was away as the job ended) and delivers it when it can (docs/reliability.md)
        "partial": bool(run) and "fin" not in run and "exit" not in run and _ended(last.get("State")),
        "live": live is not None}
    doc["advice"] = advice(doc, catalogue)
    return doc


def _would(record: dict[str, Any], run: dict[str, Any]) -> dict[str, Any] | None:
    """What enforce would have done to an observed job: the submit side's request and the node's cap/stop."""
    if record.get("decision") != "observe" or record.get("would") != "shared":
        return None
    from gpushare.slurm.gres_request import GresRequest

    found = run.get("would")
    node: dict[str, Any] = found if isinstance(found, dict) else {}
    request = GresRequest.parse(record.get("new") if isinstance(record.get("new"), str) else None)
    return {"new": request.plain() if request.text and not request.error else None, **node}


def _ended(state: str | None) -> bool:
    return (state or "").split(" ")[0] not in ("", "PENDING", "RUNNING", "REQUEUED", "SUSPENDED", "COMPLETING",
                                                 "CONFIGURING", "RESIZING")


def _gres_text(gres: dict[str, Any]) -> str | None:
    if gres.get("gpu"):
        return f"gpu:{gres['type']}:{gres['gpu']}" if gres.get("type") else f"gpu:{gres['gpu']}"
    return f"shard:{gres['shard']}" if gres.get("shard") else None


def _share_gib(gres: dict[str, Any], run: dict[str, Any], catalogue: Mapping[str, GpuModel] | None) -> float | None:
    """GPU memory the job was given: its shards (1 GiB each), else its whole GPU (by its type), else its cap."""
    if gres.get("shard") and not gres.get("gpu"):
        return float(gres["shard"])
    model = _model(gres.get("type"), catalogue)
    if gres.get("gpu") and model is not None:
        return round(model.total_gib, 2)
    cap = run.get("cap_gib")
    return float(cap) if isinstance(cap, (int, float)) else None


def _model(name: str | None, catalogue: Mapping[str, GpuModel] | None) -> GpuModel | None:
    return (BUILTIN_GPUS if catalogue is None else catalogue).get(str(name or "").lower())


def _mem_directive(peak_gib: float) -> str:
    """``#GPUSHARE mem=NG`` for a measured peak: rounded up, the margin is gpushare's to add."""
    return f"#GPUSHARE mem={max(1, math.ceil(peak_gib))}G"


def advice(doc: dict[str, Any], catalogue: Mapping[str, GpuModel] | None = None) -> str:
    """One plain-language line on how to ask next time (pure; ``catalogue`` as for :func:`summarise`)."""
    peak, share = doc.get("peak_gib"), doc.get("share_gib")
    oom = doc.get("oom")
    if isinstance(oom, dict) and doc.get("runs", 1) > 1:
        failed = _gib_of(str(oom.get("from") or ""))
        floor = f": the learned floor is now {failed * LEARN_FACTOR:g} GiB" if failed else ""
        peak_text = f"; the rerun peaked at {peak:g} GiB" if isinstance(peak, (int, float)) else ""
        return f"an OOM was recovered{floor}{peak_text}"
    if isinstance(oom, dict):
        return "the job ran out of GPU memory and was not recovered: ask for more memory (`#GPUSHARE mem=`)"
    if doc.get("partial") and not isinstance(peak, (int, float)):
        node = f" {doc['node']}" if doc.get("node") else ""
        return ("only the partial record written while the job ran is stored: its full record (peak, energy, exit) "
                f"is pending delivery from the node{node} to the accounting database; ask again shortly")
    if doc.get("stopped_by"):
        return f"gpushare stopped this job ({doc['stopped_by']}): it grew past its share; ask for its real peak"
    if not isinstance(peak, (int, float)):
        return ("no GPU measurement is stored for this job (it ran without gpushare's agent, or asked for no GPU)"
                if not doc.get("recorded") else "no GPU memory was measured: the job may never have used its GPU")
    if isinstance(share, (int, float)) and share > 0:
        if doc.get("gpu_type") and doc.get("gres", "").startswith("gpu:"):
            slice_text = _slice(doc["gpu_type"], peak, catalogue)
            if peak < GENEROUS * share:
                tail = f"; {slice_text}" if slice_text else ""
                return (f"this job peaked at {peak:g} GiB of a whole {share:g} GiB GPU: next time "
                        f"`{_mem_directive(peak)}` lets it share{tail}")
        if peak < GENEROUS * share:
            return (f"this job peaked at {peak:g} GiB of its {share:g} GiB share: next time "
                    f"`{_mem_directive(peak)}`")
        return f"its share fitted: it peaked at {peak:g} GiB of {share:g} GiB"
    return f"this job peaked at {peak:g} GiB: next time `{_mem_directive(peak)}`"


def _gib_of(gres: str) -> float | None:
    match = re.search(r"shard:(\d+)$", gres)
    return float(match.group(1)) if match else None


def _slice(gpu_type: str, peak_gib: float, catalogue: Mapping[str, GpuModel] | None) -> str:
    """"a 2g.10gb slice would have held it" when the GPU type has MIG, else ""."""
    model = _model(gpu_type, catalogue)
    if model is None or not model.mig_capable:
        return ""
    from gpushare.policy.profiles import tightest_profile

    profile = tightest_profile(model, int(peak_gib * GiB))
    return f"a {profile.name} slice would have held it" if profile is not None else ""


def _fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def _kwh(joules: Any) -> str:
    return f"{joules / 3.6e6:.3g} kWh" if isinstance(joules, (int, float)) else "-"


def _gpu_words(doc: dict[str, Any]) -> str:
    """What the job had: a share of a GPU (possibly beside other users' jobs) or a whole one, and how much of
    it the job used, in GiB and per cent: the words a researcher sizes the next request with."""
    share, peak, decision = doc.get("share_gib"), doc.get("peak_gib"), doc.get("decision")
    shared = decision == "shared" or (doc.get("gres") or "").startswith("shard")
    had = (f"a {_fmt(share, ' GiB')} share of a GPU (other jobs, possibly other users', could use the rest)"
           if shared else f"a whole GPU ({_fmt(share, ' GiB')})" if share is not None
           else f"{doc.get('gres') or 'no GPU'}")
    if doc.get("est_gib") is not None:
        had += f", sized from an estimate of {_fmt(doc['est_gib'], ' GiB')} + {_fmt(doc['margin_gib'], ' GiB')} margin"
    if isinstance(peak, (int, float)):
        used = f"used at most {peak:.2f} GiB"
        if isinstance(share, (int, float)) and share > 0:
            used += f" ({100 * peak / share:.0f} % of it)"
    elif doc.get("state") == "RUNNING":
        used = (f"its measurements so far are on its node: srun --jobid={doc['job']} --overlap gpushare jobstats "
                f"{doc['job']}")
    elif doc.get("state") in ("PENDING", "REQUEUED", "SUSPENDED"):
        used = "measurements are stored when the job ends"
    else:
        used = "no GPU memory measured"
    return f"  GPU: {had}; {used}"


def render(doc: dict[str, Any]) -> str:
    runs = f", {doc['runs']} runs" if doc["runs"] > 1 else ""
    verb = "running for" if doc.get("state") == "RUNNING" else "ran"
    so_far = " (measured so far, live from the agent on its node)" if doc.get("live") else ""
    lines = [f"Job {doc['job']} ({doc['user'] or '?'}): {doc['state']}, exit {_fmt(doc['exit_code'])}, "
             f"{verb} {_fmt(doc['elapsed_s'], ' s', 0)} on {doc['node'] or '?'}{runs}{so_far}", _gpu_words(doc)]
    for index, gpu in sorted(doc["gpus"].items()):
        lines.append(f"  GPU {index}: peak {_fmt(gpu['peak_gib'], ' GiB', 2)}, computing "
                     f"{_fmt(gpu['smact_pct'], ' %')} of the time")
    if doc.get("recorded"):
        lines.append(f"  first GPU work {_fmt(doc['ttfk_s'], ' s', 1)} after start; energy {_kwh(doc['energy_share_j'])} "
                     f"this job's part, {_kwh(doc['energy_j'])} the whole GPU; caps {doc['caps'] or '-'}")
    if doc.get("would"):
        would = doc["would"]
        stop = (f"; the backstop would have stopped it at {_fmt(would.get('over_gib'), ' GiB', 2)}"
                if would.get("stop") else "; it stayed within it")
        lines.append(f"  observe mode: it would have shared a GPU as {would.get('new') or '?'} with a "
                     f"{_fmt(would.get('cap_gib'), ' GiB', 2)} cap{stop if would.get('cap_gib') else ''}")
    if doc["oom"]:
        oom = doc["oom"]
        lines.append(f"  ran out of GPU memory ({oom.get('fam') or '?'}): requeued from {oom.get('from') or '?'} "
                     f"to {oom.get('to') or '?'} (recovery {oom.get('n', '?')} of {oom.get('max', '?')})")
    lines.append(f"Advice: {doc['advice']}")
    return "\n".join(lines)


@click.command("jobstats")
@click.argument("job_ids", metavar="[JOBID]...", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="print the versioned JSON document (docs/formats.md)")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="gpushare.toml for the [slurm] paths (default: $GPUSHARE_CONFIG, else Slurm's defaults)")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="export ended GPU jobs (these JOBIDs, else every job of --since that you may read) with each "
                   "one's GPU fraction and GPU-hours: csv, json, or xdmod (Open XDMoD's Slurm input)")
@click.option("--since", default="1d", show_default=True, help="--format without JOBIDs: jobs ended since 7d, 12h, "
              "30m before now, or an ISO date")
@click.option("--partition", default=None, help="--format: only these partitions (comma-separated, as sacct -r)")
@click.option("--account", default=None, help="--format: only these accounts (comma-separated, as sacct -A)")
def command(job_ids: tuple[str, ...], as_json: bool, config_file: str | None, fmt: str | None, since: str,
            partition: str | None, account: str | None) -> None:
    """What a job did on its GPU (from Slurm's records; a running job's so far), with advice for the next one;
    with --format, an export of many jobs for a site's own reporting."""
    try:
        ids = [check_job_id(job_id) for job_id in job_ids]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="JOBID") from None
    if fmt is not None:
        if as_json:
            raise click.UsageError("--json describes one job; --format json exports many")
        _export(ids, fmt, since, partition, account, config_file)
        return
    if len(ids) != 1:
        raise click.UsageError("one JOBID (or --format to export many)")
    job = ids[0]
    client = _client(config_file)
    try:
        runs = from_sacct(client, job)
        if runs is None:
            runs = from_scontrol(client, job)
    except SlurmError as exc:
        raise click.ClickException(str(exc)[-300:]) from None
    if not runs:
        raise NotFound(f"job {job}: not in Slurm's records, or not yours to read")
    state = (runs[-1].get("State") or "").split(" ")[0]
    doc = summarise(runs, live_summary(job, config_file) if state == "RUNNING" else None, _catalogue(config_file))
    click.echo(json.dumps(doc, sort_keys=True) if as_json else render(doc))


def export_args(ids: list[str], start: datetime, end: datetime, partition: str | None,
                account: str | None) -> list[str]:
    """sacct's arguments for the export: every run (-X -D) of the ids, else of every job the caller may read
    that ended in the period (-a: sacct shows another user's jobs only where Slurm lets the caller read them)."""
    args = ["sacct", "-n", "-P", f"--delimiter={SEP}", "-X", "-D", "-o", ",".join(EXPORT_FIELDS)]
    if ids:
        args += ["-j", ",".join(ids)]
    else:
        args += ["-a", "-S", start.strftime("%Y-%m-%dT%H:%M:%S"), "-E", end.strftime("%Y-%m-%dT%H:%M:%S")]
    if partition:
        args += ["-r", partition]
    if account:
        args += ["-A", account]
    return args


def _export(ids: list[str], fmt: str, since: str, partition: str | None, account: str | None,
            config_file: str | None) -> None:
    now = datetime.now()
    args = export_args(ids, since_time(since, now), now, partition, account)
    try:
        text = _client(config_file).run(*args)
    except SlurmError as exc:
        raise click.ClickException(f"sacct: {str(exc)[-300:]}") from None
    catalogue, node_models = _catalogue(config_file), _node_models(config_file)
    click.echo(export(parse_rows(text, SEP), fmt, catalogue, node_models), nl=False)


def _node_models(config_file: str | None) -> dict[str, str]:
    """Node name -> GPU model from the site's ``[[nodes]]`` groups (for shard jobs, whose AllocTRES may name
    no type); empty without a readable config."""
    from gpushare.config import load_config
    from gpushare.errors import GpushareError
    from gpushare.slurm.hostlist import expand_hostlist

    try:
        groups = load_config(config_file).nodes
    except (GpushareError, OSError, ValueError):
        return {}
    out: dict[str, str] = {}
    for group in groups:
        try:
            names = expand_hostlist(group.names) if group.names else []
        except ValueError:
            continue
        out.update({name: group.gpu for name in names})
    return out


def live_summary(job: str, config_file: str | None) -> dict[str, Any] | None:
    """The running job's summary so far from the agent on this host (gpushare.agent.live_api), when this is
    its node (``srun --jobid=<id> --overlap``) and the caller may read it; None otherwise."""
    from gpushare.node.api import AgentUnavailable, call
    from gpushare.node.api import live_socket_path
    from gpushare.config import AgentSection, load_config
    from gpushare.errors import GpushareError

    try:
        run_dir = load_config(config_file).agent.run_dir
    except (GpushareError, OSError, ValueError):
        run_dir = AgentSection().run_dir
    path = live_socket_path(run_dir)
    if not path.exists():
        return None
    try:
        reply = call(path, {"op": "live", "job": job}, timeout_s=3.0)
    except AgentUnavailable:
        return None
    run = reply.get("run") if reply.get("ok") else None
    return run if isinstance(run, dict) else None


def _catalogue(config_file: str | None) -> Mapping[str, GpuModel]:
    """The site's GPU catalogue (its ``[gpus.*]`` models beside the built-in ones) when a gpushare config is
    readable; the built-in one otherwise."""
    from gpushare.config import load_config
    from gpushare.errors import GpushareError

    try:
        return load_config(config_file).gpus
    except (GpushareError, OSError, ValueError):
        return BUILTIN_GPUS


def _client(config_file: str | None) -> SlurmClient:
    """The [slurm] paths when a gpushare config is readable (a login node may have none: Slurm's defaults)."""
    from gpushare.config import load_config
    from gpushare.errors import GpushareError

    try:
        return SlurmClient.from_config(load_config(config_file))
    except (GpushareError, OSError, ValueError):
        if config_file:
            raise
        return SlurmClient()
