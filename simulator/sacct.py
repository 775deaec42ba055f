"""Turn a Slurm accounting export into a simulator trace (the rich CSV format).

Export on the cluster (``-X``: one line per job allocation, not per step), either format::

    sacct -X --parsable2 --starttime 2026-11-01 --endtime 2026-11-08 \\
          --format=JobID,Submit,Start,End,AllocTRES,State,SystemComment,AdminComment > jobs.txt
    sacct -X --json --starttime 2026-11-01 --endtime 2026-11-08 > jobs.json
    python -m gpushare.simulator.sacct jobs.txt > trace.csv      # or jobs.json
    gpushare simulate --trace trace.csv --policy magm

Why these fields: Submit gives the arrival, End − Start the run time on the GPUs it had (which already
includes any slowdown from sharing on the real cluster: a what-if on a shared history is optimistic for
exclusive), AllocTRES the GPUs (``gres/gpu=N``) or shards (``gres/shard=N``, one GPU and N GiB). Peak memory:
the measured peak of gpushare's run record in the SystemComment or AdminComment (``"run": {"peak_gib": …}``, written by the
agent and the Epilog) when the job has one, else its shard count, else ``--mem-gib``. Jobs without GPUs, or
that never started, are skipped; the utilisation class is ``--util`` for all jobs.

``--json`` differs between releases (22.05 prints plain numbers and a state string, 23.02+ a state list,
24.11+ wraps numbers as ``{"set", "infinite", "number"}``); ``gpushare.slurm.jobs.number`` and
``states_of`` read every shape, as for ``squeue --json``. The AdminComment is ``comment.administrator``
(or ``admin_comment``), the SystemComment ``comment.system`` (where the node Epilog stores the run record too).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone

from gpushare.slurm import record as record_format
from gpushare.slurm.jobs import number as json_number
from gpushare.slurm.tres import gpu_tres_counts
from gpushare.simulator.trace import TraceError

_REQUIRED = ("Submit", "Start", "End", "AllocTRES")


def _time(text: str, where: str, what: str) -> datetime | None:
    if text in ("", "Unknown", "None"):
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise TraceError(f"{where}: {what} is not a time: {text!r}") from None


def _peak(admin_comment: str | None, system_comment: str | None = None) -> float | None:
    """The measured peak (GiB per GPU) of gpushare's run record (SystemComment or AdminComment), if there is one."""
    record = record_format.stored(admin_comment, system_comment)
    run = record.get("run") if record else None
    peak = json_number(run.get("peak_gib")) if isinstance(run, dict) else None
    return float(peak) if peak is not None and peak > 0 else None


def _memory(tres: dict[str, int], admin_comment: str | None, mem_gib: float,
            system_comment: str | None = None) -> float:
    peak = _peak(admin_comment, system_comment)
    if peak is not None:
        return peak
    return float(tres["shard"]) if "shard" in tres and "gpu" not in tres else mem_gib


def _trace(rows: list[tuple[datetime, str, int, float, float]], name: str, util: str) -> str:
    if not rows:
        raise TraceError(f"{name}: no GPU job that ran in the export")
    origin = min(r[0] for r in rows)
    out = ["job_id,submit_s,gpus,duration_s,mem_gib,util"]
    for submit, job_id, gpus, duration, mem in sorted(rows, key=lambda r: r[0]):
        out.append(f"{job_id},{(submit - origin).total_seconds():.0f},{gpus},{max(duration, 1.0):.0f},{mem:g},{util}")
    return "\n".join(out) + "\n"


def convert_json(text: str, name: str = "<sacct>", mem_gib: float = 8.0, util: str = "medium") -> str:
    """``sacct --json`` of any supported release → rich trace CSV text."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise TraceError(f"{name}: not valid JSON: {exc}") from None
    jobs = document.get("jobs") if isinstance(document, dict) else None
    if not isinstance(jobs, list):
        raise TraceError(f"{name}: no 'jobs' list (expected the output of sacct --json)")
    rows: list[tuple[datetime, str, int, float, float]] = []
    for k, job in enumerate(jobs):
        if not isinstance(job, dict):
            raise TraceError(f"{name}: jobs[{k}] is not an object")
        times = job.get("time")
        times = times if isinstance(times, dict) else {}
        submit, start, end = (json_number(times.get(key)) for key in ("submission", "start", "end"))
        tres: dict[str, int] = {}
        allocated = (job.get("tres") or {}).get("allocated") if isinstance(job.get("tres"), dict) else None
        for entry in allocated if isinstance(allocated, list) else []:
            if isinstance(entry, dict) and entry.get("type") == "gres":
                kind = str(entry.get("name") or "").split(":")[0]
                count = json_number(entry.get("count"))
                if kind in ("gpu", "shard") and count:
                    tres[kind] = tres.get(kind, 0) + int(count)
        if not tres or not submit or not start or not end or end < start:
            continue  # no GPU, or never ran
        comment = job.get("comment")
        admin = comment.get("administrator") if isinstance(comment, dict) else job.get("admin_comment")
        system = comment.get("system") if isinstance(comment, dict) else job.get("system_comment")
        stamp = datetime.fromtimestamp(submit, timezone.utc)
        rows.append((stamp, str(json_number(job.get("job_id")) or f"j{k}"), tres.get("gpu", 1) or 1, float(end - start),
                     _memory(tres, admin if isinstance(admin, str) else None, mem_gib,
                             system if isinstance(system, str) else None)))
    return _trace(rows, name, util)


def convert(text: str, name: str = "<sacct>", mem_gib: float = 8.0, util: str = "medium") -> str:
    """sacct --parsable2 text (with its header line), or ``--json``, → rich trace CSV text."""
    if text.lstrip().startswith("{"):
        return convert_json(text, name, mem_gib, util)
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise TraceError(f"{name}: empty sacct export")
    header = lines[0][1].split("|")
    missing = [c for c in _REQUIRED if c not in header]
    if missing:
        raise TraceError(f"{name}:{lines[0][0]}: sacct export lacks {', '.join(missing)} "
                         f"(use --parsable2 --format=JobID,Submit,Start,End,AllocTRES)")
    rows: list[tuple[datetime, str, int, float, float]] = []  # submit, job id, GPUs, run seconds, GiB
    for number, line in lines[1:]:
        where = f"{name}:{number}"
        fields = dict(zip(header, line.split("|")))
        if len(line.split("|")) != len(header):
            raise TraceError(f"{where}: expected {len(header)} '|'-separated fields")
        if "." in fields.get("JobID", ""):
            continue  # a job step; -X avoids these
        tres = gpu_tres_counts(fields["AllocTRES"])
        start, end = _time(fields["Start"], where, "Start"), _time(fields["End"], where, "End")
        submit = _time(fields["Submit"], where, "Submit")
        if not tres or start is None or end is None or submit is None:
            continue
        gpus = tres.get("gpu", 1) or 1
        mem = _memory(tres, fields.get("AdminComment"), mem_gib, fields.get("SystemComment"))
        rows.append((submit, fields.get("JobID") or f"j{len(rows)}", gpus, (end - start).total_seconds(), mem))
    return _trace(rows, name, util)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpushare.simulator.sacct", description=__doc__.splitlines()[0])
    parser.add_argument("export", help="sacct --parsable2 or --json output, or - for stdin")
    parser.add_argument("--mem-gib", type=float, default=8.0, help="peak memory for jobs without shards")
    parser.add_argument("--util", choices=("light", "medium", "heavy"), default="medium")
    args = parser.parse_args(argv)
    text = sys.stdin.read() if args.export == "-" else open(args.export).read()
    try:
        sys.stdout.write(convert(text, args.export, args.mem_gib, args.util))
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
