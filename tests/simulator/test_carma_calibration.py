"""The calibrated utilisation (``--util carma-fit``) against CARMA's measured runs on its own two traces.

Why pinned: docs/simulator.md (*Calibration*) and docs/benchmarks.md quote this table; a change to the
engine, the interference model or the fitted values that moves it must show here. The targets are
``simulator/data/carma_targets.json`` (CARMA §3.2–3.4, Appendix A.2); T1's makespans and energies must stay
within 5 percentage points of them.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpushare.simulator import report, trace
from gpushare.simulator.cli import THROUGHPUTS_NAME, data_dir
from gpushare.simulator.engine import SimConfig
from gpushare.simulator.runner import simulation

RUNS = (("rr", "none"), ("magm", "none"), ("lug", "none"), ("ff", "oracle"), ("bf", "oracle"),
        ("magm", "oracle"), ("lug", "oracle"))
METRICS = ("makespan_s", "jct_p95_s", "jct_mean_s", "energy_mj", "energy_sublinear_mj")
# trace -> "policy/estimator" -> change against Exclusive, % (makespan, p95 JCT, mean JCT, energy linear, sublinear)
PINNED: dict[int, dict[str, tuple[float, ...]]] = {
    1: {"exclusive": (38109.9, 23538.8, 14698.6, 25.3, 29.0),  # absolute: s, s, s, MJ, MJ
        "rr/none": (-29.2, -40.1, -34.7, -9.5, -16.4), "magm/none": (-33.8, -44.4, -39.5, -3.6, -13.0),
        "lug/none": (-33.0, -44.4, -38.7, -2.1, -11.7), "ff/oracle": (-37.2, -54.2, -51.5, -1.1, -11.7),
        "bf/oracle": (-36.6, -53.0, -49.7, 0.4, -11.0), "magm/oracle": (-36.0, -50.4, -46.0, 0.6, -10.7),
        "lug/oracle": (-38.9, -58.8, -54.0, -7.3, -17.1)},
    2: {"exclusive": (44664.2, 24684.4, 13617.1, 29.2, 33.7),
        "rr/none": (-31.6, -51.5, -50.5, -8.9, -15.6), "magm/none": (-30.2, -52.1, -48.6, 0.1, -9.4),
        "lug/none": (-27.9, -49.4, -46.8, -0.2, -9.1), "ff/oracle": (-32.7, -54.6, -52.2, 4.2, -7.4),
        "bf/oracle": (-32.7, -54.6, -52.2, 4.2, -7.4), "magm/oracle": (-32.1, -53.2, -53.0, 1.8, -8.7),
        "lug/oracle": (-32.9, -55.9, -53.4, 0.9, -9.3)},
}


def calibrated_table(util: str = "carma-fit") -> dict[int, dict[str, Any]]:
    """Per trace: Exclusive's absolute metrics and each run's change against it, in %."""
    data = data_dir(None)
    out: dict[int, dict[str, Any]] = {}
    for number in (1, 2):
        jobs = trace.read(data / f"carma_trace{number}.csv", seed=0)

        def run(policy: str, estimator: str) -> dict[str, Any]:
            config = SimConfig(policy=policy, estimator=estimator, throughputs=data / THROUGHPUTS_NAME, util=util)
            return report.summarise(simulation(jobs, config).run())

        base = run("exclusive", "oracle")
        table: dict[str, Any] = {"exclusive": tuple(round(base[m], 1) for m in METRICS)}
        for policy, estimator in RUNS:
            got = run(policy, estimator)
            table[f"{policy}/{estimator}"] = tuple(round(100 * (got[m] / base[m] - 1), 1) for m in METRICS)
        out[number] = table
    return out


@pytest.fixture(scope="module")
def table() -> dict[int, dict[str, Any]]:
    return calibrated_table()


def test_traces_are_carmas():
    data = data_dir(None)
    for number, hours in ((1, 3.82), (2, 5.17)):
        jobs = trace.read(data / f"carma_trace{number}.csv")
        assert len(jobs) == 60
        assert max(j.submit_s for j in jobs) / 3600 == pytest.approx(hours, abs=0.01)
        assert sum(j.gpus == 2 for j in jobs) == 3  # 5 %, though §3.1 says 10 % heavy 2-GPU tasks


def test_calibrated_table_is_as_recorded(table):
    assert {n: {k: list(v) for k, v in t.items()} for n, t in table.items()} == \
        {n: {k: list(v) for k, v in t.items()} for n, t in PINNED.items()}


def test_trace_1_is_within_5_points_of_carmas_measurements(table):
    targets = json.loads((data_dir(None) / "carma_targets.json").read_text())["targets"]
    t1 = table[1]
    by_target = {"rr": t1["rr/none"][0], "lug": t1["lug/none"][0], "magm": t1["magm/none"][0],
                 "best oracle": min(v[0] for k, v in t1.items() if k.endswith("/oracle"))}
    checked = 0
    for target in targets:
        if target["trace"] != 1:
            continue
        if target["metric"] == "makespan":
            got = by_target[target["policy"]]
            lo, hi = target.get("change_pct_range") or (target["change_pct"], target["change_pct"])
            assert lo - 5 <= got <= hi + 5, (target, got)
            checked += 1
        elif target["metric"] == "energy":  # the sublinear power curve (report.SUBLINEAR_EXPONENT)
            lo, hi = target["change_pct_range"]
            for run in ("rr/none", "magm/none", "lug/none"):
                assert lo - 5 <= t1[run][4] <= hi + 5, (target, run, t1[run])
            checked += 1
        elif target["metric"] == "p95 JCT":
            assert all(v[1] < 0 for k, v in t1.items() if k != "exclusive")
            checked += 1
    assert checked == 6


def test_trace_2_against_what_carma_states_for_it(table):
    """Trace 2 is checked, not fitted: CARMA states no number for it, only directions (carma_targets.json).

    Met: every collocating run is shorter than Exclusive; MAGM (recovery only) uses less energy than
    Exclusive under the sublinear power curve (the linear counter has it +0.1 %, a miss). Missed, and pinned
    as missed so that a change shows: MAGM is not the shortest of RR, MAGM and LUG here; RR is, then MAGM,
    then LUG."""
    targets = [t for t in json.loads((data_dir(None) / "carma_targets.json").read_text())["targets"] if t["trace"] == 2]
    assert all("change_pct" not in t and "change_pct_range" not in t for t in targets)  # no number for trace 2
    assert {(t["policy"], t["metric"]) for t in targets} == {
        ("magm", "makespan"), ("all collocating", "makespan"), ("magm", "energy")}
    t2 = table[2]
    assert all(v[0] < 0 for k, v in t2.items() if k != "exclusive")
    assert t2["magm/none"][4] < 0 < t2["magm/none"][3]  # sublinear energy below Exclusive's, linear above
    order = sorted(("rr/none", "magm/none", "lug/none"), key=lambda run: t2[run][0])
    assert order == ["rr/none", "magm/none", "lug/none"]


def test_the_assumed_classes_miss_trace_1_by_more_than_5_points():
    """Why the fit exists: with the assumed classes RR gains half of what CARMA measured."""
    t1 = calibrated_table("classes")[1]
    assert t1["rr/none"][0] > -30.6 + 5 and t1["lug/none"][0] > -35.2 + 5


if __name__ == "__main__":
    print(json.dumps(calibrated_table()))
