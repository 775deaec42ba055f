"""Interference model: measured Gavel pairs, the fallback, and how slowdowns compose."""

import pytest

from simulator.cli import data_dir
from simulator.interference import Interference

GAVEL = data_dir(None) / "gavel_simulation_throughputs.json"


def test_fallback_shares_sms_beyond_100_percent():
    model = Interference(None)
    assert model.pair(None, 0.3, None, 0.3) == pytest.approx(0.95)         # 60 % together: only overhead
    assert model.pair(None, 0.6, None, 0.6) == pytest.approx(0.95 / 1.2)   # 120 %: proportional share
    assert ("custom", "custom") in model.fallback_pairs


def test_slowdowns_add_and_scale_with_contention():
    model = Interference(None)
    # pair factor f = .95/1.2; extra time x = 1/f - 1, scaled by min(1, .6 + .6) = 1
    x = 1.2 / 0.95 - 1
    assert model.speed((None, 0.6), [(None, 0.6)]) == pytest.approx(1 / (1 + x))
    assert model.speed((None, 0.6), [(None, 0.6), (None, 0.6)]) == pytest.approx(1 / (1 + 2 * x))
    assert model.speed((None, 0.6), []) == 1.0


def test_share_mode_ignores_measurements():
    model = Interference({"v100": {"('A', 1)": {"null": 10, "('B', 1)": [1, 1]}}}, mode="share")
    assert model.speed(("A", 0.5), [("B", 0.25)]) == pytest.approx(0.95)


def test_measured_pair_and_zero_means_unknown():
    table = {"v100": {"('A', 1)": {"null": 10.0, "('B', 1)": [6.0, 3.0], "('C', 1)": [0.0, 0.0]}}}
    model = Interference(table)
    assert model.pair("A", 0.5, "B", 0.5) == pytest.approx(0.6)
    assert model.pair("A", 0.5, "C", 0.5) == pytest.approx(0.95)  # 0 = did not fit a V100: fallback
    # contention scaling: light pair (.3 + .3) pays 60 % of the measured extra time 1/.6 - 1
    assert model.speed(("A", 0.3), [("B", 0.3)]) == pytest.approx(1 / (1 + (1 / 0.6 - 1) * 0.6))


@pytest.mark.skipif(not GAVEL.exists(), reason="shared/data not present")
def test_real_gavel_table_resnet50_pair():
    model = Interference.load(GAVEL)
    assert model.measured
    f = model.pair("ResNet-50 (batch size 32)", 0.6, "ResNet-50 (batch size 32)", 0.6)
    assert 0.3 < f < 0.45  # measured on V100: two ResNet-50s each get ~37 % of their solo throughput
