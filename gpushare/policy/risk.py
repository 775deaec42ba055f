"""CARMA's collocation-interference risk score and the time-to-first-kernel (TTFK) table.

Pure policy code: samples and timestamps come in as arguments, decisions go out. The node agent feeds
it from NVML/DCGM at 1 Hz; the simulator feeds it from simulated GPUs. Both then get the same answer
to "may this GPU take another shared job now?".

Risk score (CARMA §2.3; the weights are not printed in the paper's text, they are those of CARMA's
published code, ``src/monitor.py`` in github.com/itu-rad/CARMA, ``analyze_Gmetrics``, "Linear Risk"):
for each metric series ``s`` over the window (SMACT, SMOCC, DRAMA, fractions in [0, 1])::

    score(s) = 0.2·mean(s) + 0.2·median(s) + 0.3·p95(s) + 0.1·p50(s) + 0.2·EMA(s)

with ``p95``/``p50`` linearly interpolated quantiles (pandas' default, numpy's ``linear``), and ``EMA``
the last value of the recursive average ``e₀ = s₀, eᵢ = α·sᵢ + (1−α)·eᵢ₋₁`` (pandas
``ewm(adjust=False)``) with ``α = 2/(W+1)`` for a window of ``W`` samples. median and p50 are the same
number; CARMA weights them separately, so the median effectively carries 0.3.

A GPU is *risky* when score(SMACT) ≥ 0.80 and (score(SMOCC) ≥ 0.45 or score(DRAMA) ≥ 0.40) (CARMA §2.3,
docs/architecture.md): no headroom for more concurrent kernels and already contended.

TTFK (CARMA §2.2, Table 1): a GPU that just received a job is *warming* and withheld from new shared
jobs until that job's first kernel has been seen and then one full monitoring window has passed, so the
window that decides the next placement includes the newcomer's real load.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

WINDOW_SAMPLES = 30  # CARMA §2.1: 1 Hz over a 30 s window
SAMPLE_PERIOD_S = 1.0

WEIGHTS = {"mean": 0.2, "median": 0.2, "p95": 0.3, "p50": 0.1, "ema": 0.2}


@dataclass(frozen=True)
class Thresholds:
    """When a GPU counts as risky; the defaults are CARMA's."""

    smact: float = 0.80
    smocc: float = 0.45
    drama: float = 0.40


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of a sorted sequence (numpy 'linear', pandas default)."""
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ema_last(samples: Sequence[float], alpha: float) -> float:
    """Last value of the recursive EMA seeded with the first sample (pandas ``adjust=False``)."""
    value = samples[0]
    for x in samples[1:]:
        value = alpha * x + (1.0 - alpha) * value
    return value


def score(samples: Sequence[float]) -> float:
    """CARMA's linear risk score of one metric over a window; NaN for an empty window.

    NaN rather than 0 so that a GPU without data is not mistaken for a calm one; ``assess`` treats NaN as
    not risky only because the TTFK table already withholds GPUs whose window is not yet meaningful.
    """
    values = [float(x) for x in samples if not math.isnan(float(x))]
    if not values:
        return math.nan
    ordered = sorted(values)
    alpha = 2.0 / (len(values) + 1.0)
    median = _quantile(ordered, 0.5)
    return (
        WEIGHTS["mean"] * (sum(values) / len(values))
        + WEIGHTS["median"] * median
        + WEIGHTS["p95"] * _quantile(ordered, 0.95)
        + WEIGHTS["p50"] * median
        + WEIGHTS["ema"] * ema_last(values, alpha)
    )


@dataclass(frozen=True)
class RiskAssessment:
    """The three per-metric scores of one GPU window and the verdict."""

    smact: float
    smocc: float
    drama: float
    risky: bool


def assess(
    smact: Sequence[float],
    smocc: Sequence[float],
    drama: Sequence[float],
    thresholds: Thresholds = Thresholds(),
) -> RiskAssessment:
    """Score a GPU's window and decide whether it is risky (CARMA §2.3)."""
    a, o, d = score(smact), score(smocc), score(drama)
    risky = a >= thresholds.smact and (o >= thresholds.smocc or d >= thresholds.drama)
    return RiskAssessment(a, o, d, bool(risky))


@dataclass
class MetricWindow:
    """The last ``size`` samples of SMACT/SMOCC/DRAMA of one GPU (a bounded ring, no clock inside)."""

    size: int = WINDOW_SAMPLES
    smact: deque[float] = field(default_factory=deque)
    smocc: deque[float] = field(default_factory=deque)
    drama: deque[float] = field(default_factory=deque)

    def add(self, smact: float, smocc: float, drama: float) -> None:
        for series, value in ((self.smact, smact), (self.smocc, smocc), (self.drama, drama)):
            series.append(float(value))
            while len(series) > self.size:
                series.popleft()

    def extend(self, samples: Iterable[tuple[float, float, float]]) -> None:
        for a, o, d in samples:
            self.add(a, o, d)

    @property
    def full(self) -> bool:
        return len(self.smact) >= self.size

    def assess(self, thresholds: Thresholds = Thresholds()) -> RiskAssessment:
        return assess(list(self.smact), list(self.smocc), list(self.drama), thresholds)


@dataclass
class _Entry:
    job: str
    dispatched_at: float
    kernel_at: float | None = None


class TtfkTable:
    """CARMA's TTFK bookkeeping (§2.2, Table 1) with timestamps passed in by the caller.

    ``dispatched`` marks a GPU invalid; ``kernel_seen`` records the first kernel; the GPU becomes valid
    again ``window_s`` after that kernel. A job that ends (or crashes) before its first kernel releases
    the GPU at once (CARMA's "hard lesson": a crashed task must not pin a GPU invalid forever).
    """

    def __init__(self, window_s: float = WINDOW_SAMPLES * SAMPLE_PERIOD_S) -> None:
        self.window_s = float(window_s)
        self._entries: dict[int, list[_Entry]] = {}
        self._ttfk: dict[str, float] = {}

    def dispatched(self, gpu: int, job: str, now: float) -> None:
        self._entries.setdefault(gpu, []).append(_Entry(job, float(now)))

    def kernel_seen(self, gpu: int, job: str, now: float) -> None:
        for entry in self._entries.get(gpu, []):
            if entry.job == job and entry.kernel_at is None:
                entry.kernel_at = float(now)
                self._ttfk.setdefault(job, float(now) - entry.dispatched_at)

    def job_ended(self, job: str, gpus: Iterable[int] | None = None) -> None:
        """Forget ``job`` on ``gpus`` (the GPUs it was dispatched to; every GPU when not given)."""
        for gpu in list(self._entries) if gpus is None else gpus:
            if gpu in self._entries:
                self._entries[gpu] = [e for e in self._entries[gpu] if e.job != job]

    def warming(self, gpu: int, now: float) -> bool:
        """True while any job on ``gpu`` has no first kernel yet or its kernel is younger than a window."""
        entries = self._entries.get(gpu, [])
        entries[:] = [e for e in entries if e.kernel_at is None or now - e.kernel_at < self.window_s]
        return bool(entries)

    def ready_at(self, gpu: int) -> float | None:
        """When ``gpu`` stops warming if nothing else happens; None if it waits on an unseen kernel."""
        entries = self._entries.get(gpu, [])
        if any(e.kernel_at is None for e in entries):
            return None
        return max((e.kernel_at + self.window_s for e in entries if e.kernel_at is not None), default=None)

    def ttfk(self, job: str) -> float | None:
        """Seconds from dispatch to first kernel, once seen (the job's TTFK record)."""
        return self._ttfk.get(job)
