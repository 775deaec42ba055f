"""Interference model: measured Gavel pairs, over-subscription scaling, the fallback, composition."""

import pytest

from gpushare.simulator.cli import data_dir
from gpushare.simulator.interference import Interference

GAVEL = data_dir(None) / "gavel_simulation_throughputs.json"
TABLE = {"v100": {"('A', 1)": {"null": 10.0, "('B', 1)": [4.0, 3.0], "('C', 1)": [0.0, 0.0]}}}


def test_alone_is_full_speed():
    assert Interference(TABLE).speed(("A", 0.6), []) == 1.0


def test_fallback_is_proportional_sm_share():
    model = Interference(None)
    assert model.speed((None, 0.3), [(None, 0.3)]) == pytest.approx(0.95)          # 60 %: overhead only
    assert model.speed((None, 0.6), [(None, 0.6)]) == pytest.approx(0.95 / 1.2)    # 120 %: x' = .2
    assert ("custom", "custom") in model.fallback_pairs


def test_measured_pair_scaled_by_oversubscription():
    model = Interference(TABLE)
    x = 1 / 0.4 - 1  # f(A, B) = 4/10
    assert model.speed(("A", 0.3), [("B", 0.3)]) == pytest.approx(0.95)                 # 60 %: no penalty
    assert model.speed(("A", 0.6), [("B", 0.6)]) == pytest.approx(0.95 / (1 + 0.2 * x))  # 120 %: a fifth
    assert model.speed(("A", 0.9), [("B", 0.9)]) == pytest.approx(0.95 / (1 + 0.8 * x))
    assert Interference(TABLE, mode="gavel-raw").speed(("A", 0.3), [("B", 0.3)]) == pytest.approx(0.95 / (1 + x))


def test_zero_in_gavel_means_unknown_pair():
    model = Interference(TABLE)
    assert model.measured_factor("A", "C") is None
    assert model.speed(("A", 0.6), [("C", 0.6)]) == pytest.approx(0.95 / 1.2)
    assert ("A", "C") in model.fallback_pairs


def test_extra_times_add_over_co_runners():
    model = Interference(TABLE, mode="gavel-raw")
    x = 1 / 0.4 - 1
    assert model.speed(("A", 0.6), [("B", 0.6), ("B", 0.6)]) == pytest.approx(0.95 / (1 + 2 * x))


def test_share_mode_ignores_measurements():
    model = Interference(TABLE, mode="share")
    assert not model.measured
    assert model.speed(("A", 0.5), [("B", 0.25)]) == pytest.approx(0.95)
    assert model.speed(("A", 0.6), [("B", 0.6), ("B", 0.3)]) == pytest.approx(0.95 / 1.5)


def test_real_gavel_table_resnet50_pair():
    model = Interference.load(GAVEL)
    assert model.measured
    f = model.measured_factor("ResNet-50 (batch size 32)", "ResNet-50 (batch size 32)")
    assert 0.3 < f < 0.45  # measured on V100: two ResNet-50s each get ~37 % of their solo throughput
