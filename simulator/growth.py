"""Simulated memory-growth patterns and a replay of the agent's OOM forecaster over them.

Why here: the simulator drives the same policy objects as the agent (``gpushare.policy.forecast``); this
module feeds the forecaster 1 Hz device-memory series of five shapes a training job shows, and scores
what it would have done: how long before the OOM it fired (lead time), how often it fired on a job that
never reached its cap (false positive), and how often an OOM came without a warning (missed).

Patterns (memory in GiB against a cap; parameters drawn per seed, so each pattern is a family):

``steady``   flat below the cap with small allocator jitter (never OOMs)
``step``     flat, then one step up to a new level below the cap (a new phase; never OOMs)
``leak``     linear growth from below the cap through it (OOMs)
``plateau``  fast warm-up growth that levels off below the cap (never OOMs: the classic false alarm)
``noisy``    a slow leak under heavy noise (OOMs when it reaches the cap)
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from gpushare.gpus import GiB
from gpushare.policy.forecast import ForecastConfig, JobForecaster

PATTERNS = ("steady", "step", "leak", "plateau", "noisy")


def series(pattern: str, seed: int, cap_gib: float = 20.0, duration_s: int = 1800) -> list[float]:
    """Device memory (bytes) at 1 Hz for ``duration_s`` seconds of one job of ``pattern``."""
    rng = random.Random(f"{pattern}-{seed}")
    start = rng.uniform(0.3, 0.5) * cap_gib
    shape: Callable[[float], float]
    if pattern == "steady":
        level, jitter = rng.uniform(0.4, 0.85) * cap_gib, 0.01 * cap_gib
        shape = lambda t: level + rng.gauss(0, jitter)  # noqa: E731
    elif pattern == "step":
        at, low, high = rng.uniform(300, 1200), start, rng.uniform(0.7, 0.9) * cap_gib
        shape = lambda t: (low if t < at else high) + rng.gauss(0, 0.005 * cap_gib)  # noqa: E731
    elif pattern == "leak":
        cross = rng.uniform(600, 1600)  # when it reaches the cap
        rate = (cap_gib - start) / cross
        shape = lambda t: start + rate * t + rng.gauss(0, 0.005 * cap_gib)  # noqa: E731
    elif pattern == "plateau":
        top, warm = rng.uniform(0.75, 0.92) * cap_gib, rng.uniform(120, 600)
        shape = lambda t: start + (top - start) * min(1.0, t / warm) + rng.gauss(0, 0.005 * cap_gib)  # noqa: E731
    elif pattern == "noisy":
        cross = rng.uniform(800, 1700)
        rate = (cap_gib - start) / cross
        shape = lambda t: start + rate * t + rng.gauss(0, 0.04 * cap_gib)  # noqa: E731
    else:
        raise ValueError(f"unknown pattern {pattern!r} (known: {', '.join(PATTERNS)})")
    return [max(0.0, shape(float(t))) * GiB for t in range(duration_s)]


@dataclass(frozen=True)
class Outcome:
    """One job's replay: when the OOM came (None: never) and when the forecaster fired (None: never)."""

    oom_at: float | None
    fired_at: float | None

    @property
    def lead_s(self) -> float | None:
        if self.oom_at is None or self.fired_at is None or self.fired_at > self.oom_at:
            return None
        return self.oom_at - self.fired_at


def replay(values: list[float], cap_bytes: float, cfg: ForecastConfig = ForecastConfig()) -> Outcome:
    """Feed ``values`` (1 Hz) to a fresh forecaster until the job OOMs (reaches the cap) or ends."""
    forecaster = JobForecaster(cfg)
    fired = None
    for t, value in enumerate(values):
        if value >= cap_bytes:
            return Outcome(float(t), fired)
        forecaster.observe(float(t), value)
        if forecaster.step(float(t), cap_bytes) is not None and fired is None:
            fired = float(t)
    return Outcome(None, fired)


@dataclass(frozen=True)
class PatternScore:
    pattern: str
    runs: int
    ooms: int
    warned_in_time: int
    missed: int
    false_positives: int
    lead_median_s: float | None
    lead_min_s: float | None


def score(pattern: str, seeds: int = 50, cap_gib: float = 20.0,
          cfg: ForecastConfig = ForecastConfig()) -> PatternScore:
    outcomes = [replay(series(pattern, seed, cap_gib), float(cap_gib * GiB), cfg) for seed in range(seeds)]
    leads = [o.lead_s for o in outcomes if o.lead_s is not None]
    ooms = sum(o.oom_at is not None for o in outcomes)
    return PatternScore(pattern, seeds, ooms, len(leads), ooms - len(leads),
                        sum(o.oom_at is None and o.fired_at is not None for o in outcomes),
                        statistics.median(leads) if leads else None, min(leads) if leads else None)


def table(seeds: int = 50, cfg: ForecastConfig = ForecastConfig()) -> str:
    """The benchmark table (markdown) of every pattern."""
    rows = ["| pattern | jobs | OOMs | warned before OOM | missed | false positives (rate) | lead median s | lead min s |",
            "|---|---|---|---|---|---|---|---|"]
    for pattern in PATTERNS:
        s = score(pattern, seeds, cfg=cfg)
        safe = s.runs - s.ooms
        rate = f"{s.false_positives / safe:.0%}" if safe else "–"
        fmt = lambda v: "–" if v is None else f"{v:.0f}"  # noqa: E731
        rows.append(f"| {pattern} | {s.runs} | {s.ooms} | {s.warned_in_time} | {s.missed} | "
                    f"{s.false_positives} ({rate}) | {fmt(s.lead_median_s)} | {fmt(s.lead_min_s)} |")
    return "\n".join(rows)
