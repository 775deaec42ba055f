"""Many simulations at once: every (policy, seed) of a sweep in a process of its own, with a progress bar.

Why processes: a run is pure Python and CPU-bound, so threads would share one core; each worker reads the
trace itself (with the run's seed, which drives the workload mapping) and sends back only the summary.
Results come back in the order asked, whatever order the runs finish in, so the table is deterministic.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, TextIO

from gpushare.simulator import report
from gpushare.simulator.engine import SimConfig
from gpushare.simulator.runner import simulation
from gpushare.simulator.sweep import hyperparameter_sweep
from gpushare.simulator.trace import read


@dataclass(frozen=True)
class Source:
    """Where a run's jobs come from: a trace file, or a seeded sweep of ``sweep_jobs`` small jobs."""

    trace: str | None = None
    sweep_jobs: int = 0


def run_one(source: Source, config: SimConfig) -> dict[str, Any]:
    """One run's summary (``report.summarise``); the jobs are read here, with the run's seed."""
    jobs = hyperparameter_sweep(source.sweep_jobs, config.seed) if source.sweep_jobs else read(source.trace or "", config.seed)
    return report.summarise(simulation(jobs, config).run())


class Progress:
    """``[#####-----] 5/10 runs, 12 s`` rewritten in place on a terminal; silent when off."""

    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.total, self.stream, self.done, self.started = total, stream, 0, time.monotonic()

    def step(self) -> None:
        self.done += 1
        if self.stream is None:
            return
        filled = round(20 * self.done / self.total)
        self.stream.write(f"\rsimulate: [{'#' * filled}{'-' * (20 - filled)}] {self.done}/{self.total} runs, "
                          f"{time.monotonic() - self.started:.0f} s")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def run_all(source: Source, configs: list[SimConfig], workers: int | None = None,
            progress: bool | None = None) -> list[dict[str, Any]]:
    """Every config's summary, in order; ``workers`` processes (default: one per core); ``progress``:
    a bar on stderr (default: only when stderr is a terminal)."""
    workers = max(1, min(workers or os.cpu_count() or 1, len(configs)))
    shown = sys.stderr.isatty() if progress is None else progress
    bar = Progress(len(configs), sys.stderr if shown else None)
    results: list[dict[str, Any] | None] = [None] * len(configs)
    if workers == 1:
        for k, config in enumerate(configs):
            results[k] = run_one(source, config)
            bar.step()
    else:
        with ProcessPoolExecutor(workers) as pool:
            futures = {pool.submit(run_one, source, config): k for k, config in enumerate(configs)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                bar.step()
    return [r for r in results if r is not None]


def table(summaries: list[dict[str, Any]]) -> str:
    """A Markdown table: one row per run, then per policy the mean over its seeds when it has several."""
    head = "| policy | estimator | seed | makespan h | mean JCT min | p95 JCT min | energy MJ | OOMs | failed |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def row(s: dict[str, Any], seed: str) -> str:
        return (f"| {s['policy']} | {s['estimator']} | {seed} | {s['makespan_s'] / 3600:.2f} | {s['jct_mean_s'] / 60:.1f} "
                f"| {s['jct_p95_s'] / 60:.1f} | {s['energy_mj']:.2f} | {s['ooms']:g} | {s['failed']:g} |")

    for s in summaries:
        lines.append(row(s, str(s["seed"])))
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in summaries:
        groups.setdefault((s["policy"], s["estimator"]), []).append(s)
    for (policy, estimator), runs in groups.items():
        if len(runs) > 1:
            mean = {k: statistics.mean(r[k] for r in runs)
                    for k in ("makespan_s", "jct_mean_s", "jct_p95_s", "energy_mj", "ooms", "failed")}
            lines.append(row({"policy": policy, "estimator": estimator, **mean}, f"mean of {len(runs)}"))
    return "\n".join(lines)
