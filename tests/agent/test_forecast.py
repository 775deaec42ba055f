"""The OOM forecaster (MIGM §3.2.3) is pure: series in, forecast out."""

from __future__ import annotations

import math
import random

import pytest

from gpushare.policy.forecast import ForecastConfig, JobForecaster, decide_action, fit, phase_start, predict
from gpushare.simulator.growth import GiB, replay, score, series

CAP = 20 * GiB


def test_fit_recovers_a_line_and_its_noise():
    rng = random.Random(1)
    t = [float(i) for i in range(200)]
    y = [3.0 + 0.5 * x + rng.gauss(0, 2.0) for x in t]
    line = fit(t, y)
    assert line is not None and abs(line.b - 0.5) < 0.05 and abs(line.s - 2.0) < 0.4
    # the prediction interval widens with extrapolation distance
    assert line.half_width(400.0, 2.5758) > line.half_width(100.0, 2.5758)


def test_leak_is_forecast_before_it_reaches_the_cap():
    t = [float(i) for i in range(60)]
    used = [8 * GiB + i * 0.05 * GiB for i in range(60)]  # 50 MiB/s: cap in 180 s from the end
    ahead = predict(t, used, CAP, now=59.0, cfg=ForecastConfig(horizon_s=200))
    assert ahead is not None and ahead.crossing and 150 < ahead.eta_s < 200
    short = predict(t, used, CAP, now=59.0, cfg=ForecastConfig(horizon_s=60))
    assert short is not None and not short.crossing  # beyond the horizon: not yet


def test_flat_and_noisy_flat_series_never_cross():
    rng = random.Random(2)
    t = [float(i) for i in range(120)]
    for noise in (0.0, 0.2):
        used = [15 * GiB + rng.gauss(0, noise) * GiB for _ in t]
        forecast = predict(t, used, CAP, now=119.0)
        assert forecast is not None and not forecast.crossing


def test_too_few_samples_give_no_forecast():
    assert predict([0.0, 1.0], [1.0, 2.0], CAP, now=1.0) is None


def test_a_level_shift_starts_a_new_phase():
    values = [5 * GiB] * 50 + [12 * GiB] * 30
    assert phase_start(values, ForecastConfig()) == 50
    assert phase_start([5 * GiB + i * 1e6 for i in range(80)], ForecastConfig()) == 0


def test_job_forecaster_fires_once_after_confirmation():
    cfg = ForecastConfig(horizon_s=120, confirm=3, min_samples=10)
    forecaster = JobForecaster(cfg)
    fired = []
    for i in range(200):
        forecaster.observe(float(i), 10 * GiB + i * 0.1 * GiB)
        if forecaster.step(float(i), CAP) is not None:
            fired.append(i)
    assert len(fired) == 1 and fired[0] < 100  # cap at t = 100 s


def test_decide_action():
    assert decide_action("requeue", None) == "none"
    with pytest.raises(ValueError):
        decide_action("explode", None)


@pytest.mark.parametrize("pattern", ["leak", "noisy"])
def test_growth_patterns_that_oom_are_warned_in_time(pattern):
    s = score(pattern, seeds=6)
    assert s.ooms == 6 and s.missed == 0 and s.lead_min_s is not None and s.lead_min_s > 30


@pytest.mark.parametrize("pattern", ["steady", "step"])
def test_growth_patterns_that_do_not_oom_raise_no_alarm(pattern):
    s = score(pattern, seeds=6)
    assert s.ooms == 0 and s.false_positives == 0


def test_simulated_leak_fires_before_the_cap():
    values = series("leak", 3)
    outcome = replay(values, CAP)
    assert outcome.oom_at is not None and outcome.fired_at is not None and outcome.lead_s > 60
    assert not math.isnan(outcome.lead_s)


@pytest.mark.parametrize("pattern", ["leak", "noisy", "step", "plateau"])
def test_incremental_forecaster_matches_the_one_shot_fit(pattern):
    cfg = ForecastConfig()
    values = series(pattern, 1)[:900]
    forecaster = JobForecaster(cfg)
    start = 1.7e9  # epoch-sized times: the running sums are kept relative to the first sample
    for i, value in enumerate(values):
        forecaster.observe(start + i, value)
        forecaster.step(start + i, CAP)
        if i % 97 == 0 and i > cfg.min_samples:
            times = [start + k for k in range(max(0, i - cfg.window + 1), i + 1)]
            one_shot = predict(times, values[len(values[:i + 1]) - len(times):i + 1], CAP, start + i, cfg)
            got = forecaster.last
            assert (one_shot is None) == (got is None)
            if got is not None:
                assert got.crossing == one_shot.crossing
                assert got.predicted_bytes == pytest.approx(one_shot.predicted_bytes, rel=1e-6)
