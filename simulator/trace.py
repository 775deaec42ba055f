"""Trace readers: the Philly-derived arrival CSV and the richer per-job CSV admins write themselves.

Two formats, told apart by the first non-comment line (a header means the rich format; Alibaba's
GPU-sharing trace, told by its own header, is read by ``gpushare.simulator.openb``):

* **Philly arrivals** (``simulator/data/philly_trace_60_tasks.csv``): no header, ``wait_seconds,num_tasks``
  per line, the wait counted from the previous arrival. Jobs get a workload from the table
  (``workload.draw``, seeded), and ``max(num_tasks, the workload's own GPU count)`` GPUs.
* **Rich CSV**: a header naming columns; ``submit_s`` is required (seconds from the trace start), the
  rest optional: ``job_id``, ``gpus`` (1), ``model`` and ``batch`` (a row of the workload table),
  ``duration_s`` and ``mem_gib`` (required when no model is given; override the table otherwise),
  ``util`` (light|medium|heavy, default medium), ``ttfk_s``. ``gpushare.simulator.sacct`` writes this format.

Every bad line is reported as one ``TraceError`` naming the file and line number.
"""

from __future__ import annotations

import csv
import io
import random
from dataclasses import dataclass
from pathlib import Path

from gpushare.errors import GpushareError
from gpushare.simulator import workload

TTFK_RANGE_S = {"light": (8.0, 20.0), "medium": (15.0, 45.0), "heavy": (30.0, 90.0)}  # our assumption
RICH_COLUMNS = ("job_id", "submit_s", "gpus", "model", "batch", "duration_s", "mem_gib", "util", "ttfk_s")


class TraceError(GpushareError, ValueError):
    """A trace problem, one line, with ``file:line:`` in front."""


@dataclass(frozen=True)
class JobSpec:
    """One job as the simulator replays it. Times in seconds, memory in GiB per GPU."""

    job_id: str
    submit_s: float
    gpus: int
    solo_s: float  # run time alone on a whole GPU, without start-up (TTFK)
    mem_gib: float  # true peak per GPU
    util: str  # utilisation class
    ttfk_s: float  # dispatch → first kernel
    model: str = "custom"
    batch: int = 0
    gavel: str | None = None  # interference proxy, None when unknown


def _ttfk(util: str, rng: random.Random) -> float:
    lo, hi = TTFK_RANGE_S[util]
    return round(rng.uniform(lo, hi), 1)


ttfk_draw = _ttfk  # for the other readers (gpushare.simulator.openb): the same draw from the same ranges


def _number(text: str, where: str, what: str, kind: type = float) -> float:
    try:
        value = kind(text.strip())
    except ValueError:
        raise TraceError(f"{where}: {what} must be a number, got {text.strip()!r}") from None
    if value < 0:
        raise TraceError(f"{where}: {what} must not be negative, got {text.strip()!r}")
    return value


def read(path: str | Path, seed: int = 0) -> list[JobSpec]:
    """Read a trace file in either format; ``seed`` drives workload mapping and TTFK draws."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read trace: {exc.strerror}") from exc
    return parse(text, str(path), seed)


def parse(text: str, name: str = "<trace>", seed: int = 0) -> list[JobSpec]:
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        raise TraceError(f"{name}: trace has no jobs")
    from gpushare.simulator import openb  # it imports this module

    if openb.is_openb(lines[0][1]):
        return openb.parse(text, name, seed).jobs
    rng = random.Random(seed)
    if any(c.isalpha() for c in lines[0][1]):
        return _parse_rich(lines, name, rng)
    return _parse_philly(lines, name, rng)


def _parse_philly(lines: list[tuple[int, str]], name: str, rng: random.Random) -> list[JobSpec]:
    jobs: list[JobSpec] = []
    now = 0.0
    for number, line in lines:
        where = f"{name}:{number}"
        fields = [f for f in line.split(",")]
        if len(fields) != 2:
            raise TraceError(f"{where}: expected 'wait_seconds,num_tasks', got {line.strip()!r}")
        now += _number(fields[0], where, "wait_seconds")
        tasks = int(_number(fields[1], where, "num_tasks", int))
        if tasks < 1:
            raise TraceError(f"{where}: num_tasks must be at least 1, got {tasks}")
        row, epochs = workload.draw(rng)
        jobs.append(JobSpec(
            job_id=f"j{len(jobs):03d}", submit_s=now, gpus=max(tasks, row.gpus), solo_s=row.solo_seconds(epochs),
            mem_gib=row.mem_gib, util=row.util, ttfk_s=_ttfk(row.util, rng), model=row.model, batch=row.batch,
            gavel=row.gavel,
        ))
    return jobs


def _parse_rich(lines: list[tuple[int, str]], name: str, rng: random.Random) -> list[JobSpec]:
    header_no, header_line = lines[0]
    header = [h.strip().lower() for h in next(csv.reader([header_line]))]
    unknown = [h for h in header if h not in RICH_COLUMNS]
    if unknown:
        raise TraceError(f"{name}:{header_no}: unknown column {unknown[0]!r}; known: {', '.join(RICH_COLUMNS)}")
    if "submit_s" not in header:
        raise TraceError(f"{name}:{header_no}: header must name a submit_s column")
    jobs: list[JobSpec] = []
    for number, line in lines[1:]:
        where = f"{name}:{number}"
        values = next(csv.reader(io.StringIO(line)))
        if len(values) != len(header):
            raise TraceError(f"{where}: expected {len(header)} fields ({','.join(header)}), got {len(values)}")
        row = {h: v.strip() for h, v in zip(header, values)}
        jobs.append(_rich_job(row, where, rng, len(jobs)))
    if not jobs:
        raise TraceError(f"{name}: trace has a header but no jobs")
    return sorted(jobs, key=lambda j: j.submit_s)


def _rich_job(row: dict[str, str], where: str, rng: random.Random, index: int) -> JobSpec:
    base = None
    if row.get("model"):
        batch = int(_number(row["batch"], where, "batch", int)) if row.get("batch") else None
        try:
            base = workload.lookup(row["model"], batch)
        except KeyError as exc:
            raise TraceError(f"{where}: {exc.args[0]}") from None
    for column in ("duration_s", "mem_gib"):
        if base is None and not row.get(column):
            raise TraceError(f"{where}: {column} is required when no known model is given")
    util = row.get("util") or (base.util if base else "medium")
    if util not in workload.UTIL_CLASSES:
        raise TraceError(f"{where}: util must be one of {', '.join(workload.UTIL_CLASSES)}, got {util!r}")
    gpus = int(_number(row["gpus"], where, "gpus", int)) if row.get("gpus") else (base.gpus if base else 1)
    if gpus < 1:
        raise TraceError(f"{where}: gpus must be at least 1, got {gpus}")
    if row.get("duration_s"):
        solo = _number(row["duration_s"], where, "duration_s")
    else:
        assert base is not None  # a missing column without a known model raised above
        solo = base.solo_seconds(base.epochs[0])
    if row.get("mem_gib"):
        mem = _number(row["mem_gib"], where, "mem_gib")
    else:
        assert base is not None  # as above
        mem = base.mem_gib
    ttfk = _number(row["ttfk_s"], where, "ttfk_s") if row.get("ttfk_s") else _ttfk(util, rng)
    return JobSpec(
        job_id=row.get("job_id") or f"j{index:03d}", submit_s=_number(row["submit_s"], where, "submit_s"),
        gpus=gpus, solo_s=solo, mem_gib=mem, util=util, ttfk_s=ttfk,
        model=base.model if base else "custom", batch=base.batch if base else 0, gavel=base.gavel if base else None,
    )
