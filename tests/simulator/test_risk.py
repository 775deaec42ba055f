"""CARMA risk score numbers and TTFK windows (gpushare.policy.risk)."""

import math
import random

import numpy as np
import pytest

from gpushare.policy import risk


def test_constant_window_scores_its_value():
    # weights sum to 1, every statistic of a constant series is the constant
    assert risk.score([0.42] * 30) == pytest.approx(0.42)


def test_two_sample_window_by_hand():
    # samples 0, 1 (W=2, alpha=2/3): mean .5, median .5, p95 .95, p50 .5, EMA = 2/3*1 + 1/3*0 = .6667
    # 0.2*.5 + 0.2*.5 + 0.3*.95 + 0.1*.5 + 0.2*.6667 = .1 + .1 + .285 + .05 + .13333 = .66833
    assert risk.score([0.0, 1.0]) == pytest.approx(0.668333, abs=1e-6)


def test_matches_numpy_quantiles_and_recursive_ema():
    rng = random.Random(3)
    samples = [rng.random() for _ in range(30)]
    alpha = 2 / 31
    ema = samples[0]
    for x in samples[1:]:
        ema = alpha * x + (1 - alpha) * ema
    expected = (0.2 * np.mean(samples) + 0.2 * np.median(samples) + 0.3 * np.quantile(samples, 0.95)
                + 0.1 * np.quantile(samples, 0.5) + 0.2 * ema)
    assert risk.score(samples) == pytest.approx(expected, rel=1e-12)


def test_empty_window_is_nan_and_not_risky():
    assert math.isnan(risk.score([]))
    assert not risk.assess([], [], []).risky


@pytest.mark.parametrize("smact, smocc, drama, risky", [
    (0.80, 0.45, 0.00, True),   # both SMACT and SMOCC at threshold
    (0.80, 0.00, 0.40, True),   # DRAMA instead of SMOCC
    (0.79, 0.90, 0.90, False),  # SMACT just below: never risky
    (0.80, 0.44, 0.39, False),  # busy but neither full nor memory-bound
    (1.00, 0.44, 0.40, True),
])
def test_thresholds(smact, smocc, drama, risky):
    assert risk.assess([smact] * 30, [smocc] * 30, [drama] * 30).risky is risky


def test_window_keeps_last_30_samples():
    window = risk.MetricWindow()
    window.extend((1.0, 1.0, 1.0) for _ in range(10))
    window.extend((0.0, 0.0, 0.0) for _ in range(30))
    assert window.full and len(window.smact) == 30
    assert not window.assess().risky and window.assess().smact == 0.0


def test_ttfk_window():
    table = risk.TtfkTable(window_s=30)
    table.dispatched(0, "a", now=0)
    assert table.warming(0, now=5) and not table.warming(1, now=5)
    assert table.ready_at(0) is None  # waits for the first kernel, however long
    assert table.warming(0, now=500)
    table.kernel_seen(0, "a", now=12)
    assert table.ttfk("a") == 12
    assert table.ready_at(0) == 42
    assert table.warming(0, now=41.9)
    assert not table.warming(0, now=42)  # first kernel + one window


def test_ttfk_job_that_dies_before_its_kernel_releases_the_gpu():
    table = risk.TtfkTable()
    table.dispatched(2, "a", now=0)
    table.job_ended("a")
    assert not table.warming(2, now=1)


def test_ttfk_second_job_restarts_the_wait():
    table = risk.TtfkTable(window_s=30)
    table.dispatched(0, "a", now=0)
    table.kernel_seen(0, "a", now=10)
    table.dispatched(0, "b", now=45)
    assert table.warming(0, now=46)
    table.kernel_seen(0, "b", now=50)
    assert table.warming(0, now=79) and not table.warming(0, now=80)
