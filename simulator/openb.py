"""Alibaba's GPU-sharing production trace (``cluster-trace-gpu-v2023``, files ``openb_pod_list_*.csv``) as jobs.

Why a reader of its own: the trace is the published record of a production cluster whose tasks ask for
*fractions* of a GPU (``gpu_milli``), the demand GPU sharing exists for; the rich CSV cannot say that.
The data is not shipped with the package (docs/simulator.md, *Alibaba's GPU-sharing trace*, says where to
get it and under which terms); the admin names the file.

Columns (header required; others, e.g. ``cpu_milli``, ``qos``, ``gpu_spec``, are read past): ``name``,
``num_gpu`` (0-8), ``gpu_milli`` (1-1000, thousandths of one GPU; 1000 for multi-GPU tasks),
``creation_time``, ``scheduled_time`` (empty: never scheduled), ``deletion_time`` (seconds). One task
becomes one job:

* arrival = ``creation_time`` − the first one; run time = ``deletion_time`` − ``scheduled_time`` (the
  production cluster ran it alone on its share; tasks still running at the trace's end are cut there, as
  the trace itself cuts them);
* per-GPU memory = ``gpu_milli`` / 1000 of ``GPU_GIB`` (32 GiB: a V100-32GB, the trace's largest disclosed
  model; simulate with ``--gpu v100-32gb`` so that a share of memory is a share of the GPU);
* utilisation class from the share (our assumption: the trace has no utilisation): ≤ 0.4 light,
  < 1 medium, a whole GPU heavy;
* CPU-only tasks (``num_gpu`` 0) and tasks never scheduled (no run time) are left out and counted
  (:class:`OpenbTrace`).

A bad line stops the read with one ``TraceError`` naming the file, the line and the column; nothing is
returned for a file with any bad line.
"""

from __future__ import annotations

import csv
import io
import random
from dataclasses import dataclass

from gpushare.simulator.trace import JobSpec, TraceError, ttfk_draw

GPU_GIB = 32.0
REQUIRED = ("name", "num_gpu", "gpu_milli", "creation_time", "scheduled_time", "deletion_time")
LIGHT_MAX_SHARE = 0.4  # a share at or below this is a light job (SMACT class), our assumption


@dataclass(frozen=True)
class OpenbTrace:
    """The jobs of one trace file and what was left out of it."""

    jobs: list[JobSpec]
    cpu_only: int  # tasks without GPUs
    never_scheduled: int  # tasks with no scheduled_time: no run time to replay


def is_openb(header_line: str) -> bool:
    """Whether a CSV header is the trace's: it names one of the columns only the trace has (so that a
    header missing the others is reported by this reader, naming them)."""
    names = {h.strip().lower() for h in next(csv.reader([header_line]), [])}
    return bool({"num_gpu", "gpu_milli", "creation_time", "scheduled_time"} & names)


def share_of(job: JobSpec) -> float:
    """The GPU share the task asked for, from the job this reader made of it."""
    return round(job.mem_gib / GPU_GIB, 3)


def util_class(share: float) -> str:
    return "light" if share <= LIGHT_MAX_SHARE else "medium" if share < 1.0 else "heavy"


def parse(text: str, name: str = "<trace>", seed: int = 0) -> OpenbTrace:
    """The trace's tasks as jobs; ``seed`` drives the TTFK draws."""
    reader = csv.reader(io.StringIO(text))
    header = [h.strip().lower() for h in next(reader, [])]
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise TraceError(f"{name}:1: column {missing[0]!r} missing from the header; needs {', '.join(REQUIRED)}")
    at = {c: header.index(c) for c in REQUIRED}
    rng = random.Random(seed)
    rows: list[tuple[str, int, float, int, int]] = []  # name, GPUs, share, creation, run seconds
    cpu_only = never = 0
    for number, values in enumerate(reader, 2):
        if not values or not any(v.strip() for v in values):
            continue
        if len(values) != len(header):
            raise TraceError(f"{name}:{number}: expected {len(header)} columns, got {len(values)}")

        def field(column: str, number: int = number, values: list[str] = values) -> str:
            return values[at[column]].strip()

        def integer(column: str, lo: int, hi: int | None = None) -> int:
            text = field(column)
            try:
                value = int(text)
            except ValueError:
                raise TraceError(f"{name}:{number}: column {column} must be a whole number, got {text!r}") from None
            if value < lo or (hi is not None and value > hi):
                bound = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
                raise TraceError(f"{name}:{number}: column {column} must be {bound}, got {value}")
            return value

        gpus = integer("num_gpu", 0, 64)
        created = integer("creation_time", 0)
        if not field("name"):
            raise TraceError(f"{name}:{number}: column name is empty")
        if gpus == 0:
            cpu_only += 1
            continue
        milli = integer("gpu_milli", 1, 1000)
        if gpus > 1 and milli != 1000:
            raise TraceError(f"{name}:{number}: column gpu_milli must be 1000 for a task of {gpus} GPUs, got {milli}")
        if not field("scheduled_time"):
            never += 1
            continue
        scheduled = integer("scheduled_time", created)
        deleted = integer("deletion_time", scheduled)
        rows.append((field("name"), gpus, milli / 1000.0, created, deleted - scheduled))
    if not rows:
        raise TraceError(f"{name}: no task with GPUs that was ever scheduled")
    start = min(r[3] for r in rows)
    jobs = []
    for task, gpus, share, created, run_s in sorted(rows, key=lambda r: (r[3], r[0])):
        util = util_class(share)
        jobs.append(JobSpec(job_id=task, submit_s=float(created - start), gpus=gpus, solo_s=float(max(run_s, 1)),
                            mem_gib=share * GPU_GIB, util=util, ttfk_s=ttfk_draw(util, rng)))
    return OpenbTrace(jobs, cpu_only, never)
