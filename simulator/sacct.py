"""Turn a Slurm accounting export into a simulator trace (the rich CSV format).

Export on the cluster (``-X``: one line per job allocation, not per step)::

    sacct -X --parsable2 --starttime 2026-11-01 --endtime 2026-11-08 \\
          --format=JobID,Submit,Start,End,AllocTRES,State > jobs.txt
    python -m gpushare.simulator.sacct jobs.txt > trace.csv
    gpushare simulate --trace trace.csv --policy magm

Why these fields: Submit gives the arrival, End − Start the run time on the GPUs it had (which already
includes any slowdown from sharing on the real cluster: a what-if on a shared history is optimistic for
exclusive), AllocTRES the GPUs (``gres/gpu=N``) or shards (``gres/shard=N``, one GPU and N GiB). Peak memory
is not in accounting: a shard count is used when there is one, else ``--mem-gib``. Jobs without GPUs, or
that never started, are skipped; the utilisation class is ``--util`` for all jobs.
"""

from __future__ import annotations

import argparse
import re
import sys
from datetime import datetime

from gpushare.simulator.trace import TraceError

_TRES = re.compile(r"gres/(gpu|shard)(?::[^=,]+)?=(\d+)")
_REQUIRED = ("Submit", "Start", "End", "AllocTRES")


def _time(text: str, where: str, what: str) -> datetime | None:
    if text in ("", "Unknown", "None"):
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise TraceError(f"{where}: {what} is not a time: {text!r}") from None


def convert(text: str, name: str = "<sacct>", mem_gib: float = 8.0, util: str = "medium") -> str:
    """sacct --parsable2 text (with its header line) → rich trace CSV text."""
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
        tres = {kind: int(count) for kind, count in _TRES.findall(fields["AllocTRES"])}
        start, end = _time(fields["Start"], where, "Start"), _time(fields["End"], where, "End")
        submit = _time(fields["Submit"], where, "Submit")
        if not tres or start is None or end is None or submit is None:
            continue
        gpus = tres.get("gpu", 1) or 1
        mem = float(tres["shard"]) if "shard" in tres and "gpu" not in tres else mem_gib
        rows.append((submit, fields.get("JobID") or f"j{len(rows)}", gpus, (end - start).total_seconds(), mem))
    if not rows:
        raise TraceError(f"{name}: no GPU job that ran in the export")
    origin = min(r[0] for r in rows)
    out = ["job_id,submit_s,gpus,duration_s,mem_gib,util"]
    for submit, job_id, gpus, duration, mem in sorted(rows, key=lambda r: r[0]):
        out.append(f"{job_id},{(submit - origin).total_seconds():.0f},{gpus},{max(duration, 1.0):.0f},{mem:g},{util}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpushare.simulator.sacct", description=__doc__.splitlines()[0])
    parser.add_argument("export", help="sacct --parsable2 output, or - for stdin")
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
