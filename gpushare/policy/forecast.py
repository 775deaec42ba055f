"""Runtime OOM forecaster: will this job's device memory cross its cap within the horizon? Pure.

The method is MIGM's time-series predictor (MIGM §3.2.3): fit a straight line ``m(t) = a + b·t`` to the
memory a job has requested so far, model the residuals as normal, and take the upper end of a 99 %
interval at a future time as the predicted need. MIGM fits a second line to the *inverse reuse ratio*
(requested / physically held, from its instrumented allocator) and combines the two to turn requested
memory into physical memory. The agent reads NVML's per-process used memory, which is already physical
memory, so its reuse series is absent (ratio 1); a caller that has both series (the simulator, or a
framework hook) passes ``inverse_reuse`` and the prediction divides the requested upper bound by the
inverse-reuse lower bound (the conservative combination: most requested, least reuse).

What is adapted, and why:

- The fit runs over the last ``window`` samples, not the whole run: a step (a new phase) or a plateau
  must not be drowned by the job's history.
- The interval is the regression *prediction* interval at ``t + horizon`` (``z·s·√(1 + 1/n + (x−x̄)²/Sxx)``),
  MIGM's ``z·σ`` widened for extrapolation so few points do not look certain.
- A level shift (one sample-to-sample jump larger than ``jump_factor`` × the window's median absolute
  step, and larger than ``jump_min_bytes``) starts a new phase: only the samples after it are fitted. A
  line through two levels would read a one-off step (a new phase, a larger batch) as steep growth.
- A warning needs ``confirm`` consecutive positive forecasts and a positive lower-bound slope: one noisy
  sample must not requeue a healthy job (the false positives the benchmark counts).

No I/O and no clock: samples in, :class:`Forecast` out. The agent and the simulator are its drivers.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

Z99 = 2.5758  # two-sided 99 % normal quantile (MIGM §3.2.3's 99 % interval)
ACTIONS = ("none", "warn", "requeue")


@dataclass(frozen=True)
class ForecastConfig:
    """Knobs of the forecaster (``[agent] forecast_*``)."""

    horizon_s: float = 120.0  # how far ahead a crossing counts
    window: int = 120  # samples in the fit (1 Hz: two minutes)
    min_samples: int = 20  # no forecast before this many samples
    confirm: int = 5  # consecutive positive forecasts before acting
    z: float = Z99
    jump_factor: float = 10.0  # a step this many median steps high starts a new phase
    jump_min_bytes: float = float(256 << 20)


@dataclass(frozen=True)
class Line:
    """A least-squares line over (t, y) with what the prediction interval needs."""

    a: float
    b: float
    s: float  # residual standard deviation (n − 2 degrees of freedom)
    n: int
    t_mean: float
    sxx: float

    def at(self, t: float) -> float:
        return self.a + self.b * t

    def half_width(self, t: float, z: float) -> float:
        if self.n < 3 or self.sxx <= 0:
            return math.inf
        return z * self.s * math.sqrt(1.0 + 1.0 / self.n + (t - self.t_mean) ** 2 / self.sxx)

    def slope_low(self, z: float) -> float:
        """Lower end of the slope's interval (is the growth real, or noise?)."""
        if self.n < 3 or self.sxx <= 0:
            return -math.inf
        return self.b - z * self.s / math.sqrt(self.sxx)


def fit(times: Sequence[float], values: Sequence[float]) -> Line | None:
    """Ordinary least squares; None with fewer than two distinct times."""
    n = len(times)
    if n < 2 or n != len(values):
        return None
    t_mean = sum(times) / n
    y_mean = sum(values) / n
    sxx = sum((t - t_mean) ** 2 for t in times)
    if sxx <= 0:
        return None
    b = sum((t - t_mean) * (y - y_mean) for t, y in zip(times, values)) / sxx
    a = y_mean - b * t_mean
    sse = sum((y - (a + b * t)) ** 2 for t, y in zip(times, values))
    s = math.sqrt(sse / (n - 2)) if n > 2 else 0.0
    return Line(a, b, s, n, t_mean, sxx)


def phase_start(values: Sequence[float], cfg: ForecastConfig) -> int:
    """Index where the current phase begins: just after the last level shift in ``values`` (else 0)."""
    steps = [abs(b - a) for a, b in zip(values, values[1:])]
    if len(steps) < 3:
        return 0
    ordered = sorted(steps)
    median = ordered[len(ordered) // 2]
    limit = max(cfg.jump_factor * median, cfg.jump_min_bytes)
    for i in range(len(steps) - 1, -1, -1):
        if steps[i] > limit:
            return i + 1
    return 0


@dataclass(frozen=True)
class Forecast:
    """One forecast of one job. ``crossing`` is True when the upper bound reaches the cap in the horizon."""

    predicted_bytes: float  # upper bound of physical memory at now + horizon
    trend_bytes_per_s: float
    crossing: bool
    eta_s: float | None  # seconds until the trend's upper bound reaches the cap (None: not growing)
    samples: int


def predict(times: Sequence[float], requested: Sequence[float], cap_bytes: float, now: float,
            cfg: ForecastConfig = ForecastConfig(),
            inverse_reuse: Sequence[float] | None = None) -> Forecast | None:
    """MIGM §3.2.3 over the last ``cfg.window`` samples; None before ``cfg.min_samples``."""
    times, requested = list(times)[-cfg.window:], list(requested)[-cfg.window:]
    start = phase_start(requested, cfg)
    times, requested = times[start:], requested[start:]
    if inverse_reuse is not None:
        inverse_reuse = list(inverse_reuse)[-cfg.window:][start:]
    if len(times) < cfg.min_samples:
        return None
    line = fit(times, requested)
    if line is None:
        return None
    reuse = fit(times, list(inverse_reuse)) if inverse_reuse is not None else None
    return forecast_from(line, now, cap_bytes, cfg, reuse)


def forecast_from(line: Line, now: float, cap_bytes: float, cfg: ForecastConfig, reuse: Line | None = None) -> Forecast:
    """The forecast a fitted line (and optional inverse-reuse line) gives at ``now``."""
    target = now + cfg.horizon_s
    upper = line.at(target) + line.half_width(target, cfg.z)
    if reuse is not None:
        low = max(1.0, reuse.at(target) - reuse.half_width(target, cfg.z))
        upper /= low
    growing = line.slope_low(cfg.z) > 0
    eta = None
    if line.b > 0:
        current = line.at(now) + line.half_width(now, cfg.z)
        eta = max(0.0, (cap_bytes - current) / line.b)
    return Forecast(upper, line.b, bool(growing and upper >= cap_bytes), eta, line.n)


@dataclass
class JobForecaster:
    """Per-job state: the current phase's samples with running sums, and the run of positive forecasts.

    ``observe(t, bytes)`` appends a sample; ``step(now, cap)`` forecasts and returns the forecast the
    first time ``confirm`` consecutive forecasts say "crossing" (the moment to act; once per job).
    Incremental — O(1) sums plus a sorted list of the window's steps — because the agent runs it every
    second for every shared job: the same fit as :func:`predict`, without re-reading the window. Times are
    kept relative to the first sample so the sums stay exact enough in float64.
    """

    cfg: ForecastConfig = field(default_factory=ForecastConfig)
    streak: int = 0
    fired: bool = False
    last: Forecast | None = None
    _t0: float | None = None
    _points: deque[tuple[float, float]] = field(default_factory=deque)  # the current phase
    _steps: deque[float] = field(default_factory=deque)  # |Δ| of the last window's samples, in order
    _sorted: list[float] = field(default_factory=list)  # the same, sorted (for the median)
    _last_y: float | None = None
    _sums: list[float] = field(default_factory=lambda: [0.0] * 6)  # n, Σt, Σy, Σtt, Σty, Σyy
    _since_rebuild: int = 0

    def observe(self, t: float, used_bytes: float) -> None:
        if self._t0 is None:
            self._t0 = float(t)
        x, y = float(t) - self._t0, float(used_bytes)
        if self._last_y is not None:
            step = abs(y - self._last_y)
            self._steps.append(step)
            bisect.insort(self._sorted, step)
            if len(self._steps) > self.cfg.window - 1:
                old = self._steps.popleft()
                del self._sorted[bisect.bisect_left(self._sorted, old)]
            if len(self._steps) >= 3:
                median = self._sorted[len(self._sorted) // 2]
                if step > max(self.cfg.jump_factor * median, self.cfg.jump_min_bytes):
                    self._points.clear()  # a level shift: a new phase starts with this sample
                    self._sums = [0.0] * 6
        self._last_y = y
        self._add(x, y, 1.0)
        self._points.append((x, y))
        if len(self._points) > self.cfg.window:
            self._add(*self._points.popleft(), -1.0)
        self._since_rebuild += 1
        if self._since_rebuild >= 4 * self.cfg.window:  # no drift from adding and subtracting for days
            self._sums = [0.0] * 6
            for px, py in self._points:
                self._add(px, py, 1.0)
            self._since_rebuild = 0

    def _add(self, x: float, y: float, sign: float) -> None:
        s = self._sums
        s[0] += sign
        s[1] += sign * x
        s[2] += sign * y
        s[3] += sign * x * x
        s[4] += sign * x * y
        s[5] += sign * y * y

    def line(self) -> Line | None:
        """The least-squares line of the current phase (times relative to the first sample)."""
        n, st, sy, stt, sty, syy = self._sums
        if n < 2:
            return None
        t_mean, y_mean = st / n, sy / n
        sxx = stt - n * t_mean * t_mean
        if sxx <= 1e-9:
            return None
        sxy = sty - n * t_mean * y_mean
        b = sxy / sxx
        sse = max(0.0, (syy - n * y_mean * y_mean) - b * sxy)
        s = math.sqrt(sse / (n - 2)) if n > 2 else 0.0
        return Line(y_mean - b * t_mean, b, s, int(round(n)), t_mean, sxx)

    def step(self, now: float, cap_bytes: float) -> Forecast | None:
        """The forecast now (``last``); returns it the first time the streak reaches ``confirm``."""
        line = self.line() if len(self._points) >= self.cfg.min_samples else None
        self.last = None if line is None or self._t0 is None else forecast_from(line, now - self._t0, cap_bytes,
                                                                                 self.cfg)
        self.streak = self.streak + 1 if self.last is not None and self.last.crossing else 0
        if self.streak >= self.cfg.confirm and not self.fired:
            self.fired = True
            return self.last
        return None


def decide_action(action: str, forecast: Forecast | None) -> str:
    """What to do about a fired forecast: ``none``, ``warn`` or ``requeue`` (``[agent] forecast_action``)."""
    if action not in ACTIONS:
        raise ValueError(f"unknown forecast action {action!r} (known: {', '.join(ACTIONS)})")
    return "none" if forecast is None else action
