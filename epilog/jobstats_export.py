"""``gpushare jobstats --format csv|json|xdmod``: ended GPU jobs with their GPU fraction, for a site's reporting.

Why: a shared job holds ``gres/shard=N``, not ``gres/gpu``, so tools that count GPUs from ``gres/gpu`` (XDMoD,
``sreport --tres=gres/gpu``) give it zero GPU-hours, and per-device tools (Princeton's jobstats) cannot tell two
jobs on one GPU apart (docs/agent.md, *What a site's existing reporting sees for shared jobs*). This export
gives each job the fraction of a GPU it held and the GPU-hours that fraction makes:

- a whole-GPU job: its ``gres/gpu`` count (basis ``gres/gpu``);
- a shared job: its shards over its GPU model's shards (1 GiB each, ``GpuModel.shards``), the model from the
  job's ``AllocTRES`` type, else from the ``[[nodes]]`` group that names its node (basis ``shards``); with no
  known model the fraction is left empty (basis ``unknown``), never guessed;

with the facts of our stored record beside them (decision, estimate, measured peak, the job's part of the
GPU's energy). Rows: one per run of each ended GPU job (``sacct -X -D``), as the caller may read them.

``xdmod``: the 26 fields in the order Open XDMoD's Slurm input takes them (``xdmod-shredder -f slurm``: its
documented ``sacct --parsable2 --noheader --allocations --duplicates --format jobid,jobidraw,...,jobname``),
``|``-separated, with one change: a shared job's AllocTRES also names ``gres/gpu=<fraction>`` (e.g. ``0.225``),
where XDMoD reads a job's GPU count. Pure: rows in, text out; the sacct call is jobstats_cli's.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping
from typing import Any

from gpushare.gpus import GpuModel
from gpushare.slurm import record as record_format
from gpushare.slurm.hostlist import expand_hostlist
from gpushare.slurm.tres import gpu_tres

VERSION = 1
FORMATS = ("csv", "json", "xdmod")
XDMOD_FIELDS = ("JobID", "JobIDRaw", "Cluster", "Partition", "QOS", "Account", "Group", "GID", "User", "UID", "Submit",
                "Eligible", "Start", "End", "Elapsed", "ExitCode", "State", "NNodes", "NCPUS", "ReqCPUS", "ReqMem",
                "ReqTRES", "AllocTRES", "Timelimit", "NodeList", "JobName")
#: what sacct is asked for: XDMoD's fields, then our record's two homes (free text: last)
FIELDS = XDMOD_FIELDS + ("SystemComment", "AdminComment")
COLUMNS = ("job", "job_id_raw", "user", "account", "partition", "state", "submit", "start", "end", "elapsed_s",
           "node", "gpu_type", "gpus", "shards", "gpu_fraction", "gpu_hours", "basis", "decision", "est_gib",
           "peak_gib", "energy_share_j")
# a run still going (an earlier run of a requeued job, REQUEUED, has ended: it is exported)
_RUNNING = ("", "PENDING", "RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING", "RESIZING")


def parse_rows(text: str, sep: str) -> list[dict[str, str]]:
    """``sacct -n -P --delimiter=SEP -o FIELDS`` output -> rows (only the last column may hold ``sep``)."""
    rows = []
    for line in text.splitlines():
        parts = line.split(sep, len(FIELDS) - 1)
        if len(parts) == len(FIELDS):
            rows.append(dict(zip(FIELDS, parts)))
    return rows


def _elapsed_s(text: str) -> float | None:
    days, _, clock = text.strip().rpartition("-")
    parts = clock.split(":")
    if not 2 <= len(parts) <= 3 or not all(p.replace(".", "", 1).isdigit() for p in parts) or (days and not days.isdigit()):
        return None
    seconds = 0.0
    for part in parts:
        seconds = seconds * 60 + float(part)
    return seconds + int(days or 0) * 86400


def _model(gpu_type: str | None, node: str, catalogue: Mapping[str, GpuModel],
           node_models: Mapping[str, str]) -> GpuModel | None:
    first = next(iter(expand_hostlist(node, limit=1)), "") if node and not gpu_type else ""
    name = gpu_type or node_models.get(first)
    return catalogue.get(name.lower()) if name else None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def job_row(row: dict[str, str], catalogue: Mapping[str, GpuModel], node_models: Mapping[str, str]) -> dict[str, Any] | None:
    """One export row for an ended GPU job's run; None for a job that held no GPU or has not ended."""
    state = (row.get("State") or "").split(" ")[0]
    gres = gpu_tres(row.get("AllocTRES", ""))
    gpus, shards = int(gres.get("gpu", 0)), int(gres.get("shard", 0))
    if state in _RUNNING or not (gpus or shards):
        return None
    record = record_format.stored(row.get("AdminComment"), row.get("SystemComment")) or {}
    found = record.get("run")
    run: dict[str, Any] = found if isinstance(found, dict) else {}
    node = row.get("NodeList", "")
    model = _model(gres.get("type"), node, catalogue, node_models)
    if gpus:
        fraction, basis = float(gpus), "gres/gpu"
    elif model is not None and model.shards > 0:
        fraction, basis = min(1.0, shards / model.shards), "shards"
    else:
        fraction, basis = None, "unknown"
    elapsed = _elapsed_s(row.get("Elapsed", ""))
    return {"job": row.get("JobID") or row.get("JobIDRaw"), "job_id_raw": row.get("JobIDRaw"),
            "user": row.get("User") or None, "account": row.get("Account") or None,
            "partition": row.get("Partition") or None, "state": state,
            "submit": row.get("Submit") or None, "start": row.get("Start") or None, "end": row.get("End") or None,
            "elapsed_s": elapsed, "node": node or None, "gpu_type": model.name if model else gres.get("type"),
            "gpus": gpus, "shards": shards,
            "gpu_fraction": round(fraction, 4) if fraction is not None else None,
            "gpu_hours": round(fraction * elapsed / 3600, 6) if fraction is not None and elapsed is not None else None,
            "basis": basis, "decision": record.get("decision"), "est_gib": _num(record.get("est_gib")),
            "peak_gib": _num(run.get("peak_gib")), "energy_share_j": _num(run.get("share_j"))}


def _xdmod_line(row: dict[str, str], out: dict[str, Any]) -> str:
    values = {k: (row.get(k) or "").replace("|", "_") for k in XDMOD_FIELDS}
    if out["basis"] == "shards" and out["gpu_fraction"] is not None:
        fraction = f"{out['gpu_fraction']:.4f}".rstrip("0").rstrip(".")
        values["AllocTRES"] = ",".join(filter(None, (values["AllocTRES"], f"gres/gpu={fraction}")))
    return "|".join(values[k] for k in XDMOD_FIELDS)


def export(rows: list[dict[str, str]], fmt: str, catalogue: Mapping[str, GpuModel],
           node_models: Mapping[str, str] | None = None) -> str:
    """The export of ``rows`` (parse_rows) in ``fmt``: csv (a header, then one line per run), json (``{"v",
    "jobs", "gpu_hours"}``) or xdmod (XDMoD's Slurm input lines, no header)."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
    pairs = [(row, out) for row in rows if (out := job_row(row, catalogue, node_models or {})) is not None]
    if fmt == "xdmod":
        return "".join(_xdmod_line(row, out) + "\n" for row, out in pairs)
    jobs = [out for _, out in pairs]
    if fmt == "json":
        total = round(sum(j["gpu_hours"] for j in jobs if j["gpu_hours"] is not None), 6)
        return json.dumps({"v": VERSION, "jobs": jobs, "gpu_hours": total}, sort_keys=True) + "\n"
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for job in jobs:
        writer.writerow({k: "" if job[k] is None else job[k] for k in COLUMNS})
    return buffer.getvalue()
