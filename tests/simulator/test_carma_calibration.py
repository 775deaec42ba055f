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
    1: {"exclusive": (38109.9, 23538.8, 14698.6, 25.8, 29.5),  # absolute: s, s, s, MJ, MJ
        "rr/none": (-31.4, -43.6, -39.5, -11.6, -18.6), "magm/none": (-34.6, -48.8, -41.8, -3.0, -12.6),
        "lug/none": (-34.2, -49.4, -42.0, -2.8, -12.1), "ff/oracle": (-37.9, -55.6, -51.9, -2.0, -12.8),
        "bf/oracle": (-38.6, -53.5, -49.6, -1.4, -12.5), "magm/oracle": (-39.0, -59.1, -54.1, -7.4, -17.2),
        "lug/oracle": (-39.0, -59.1, -54.1, -7.4, -17.2)},
    2: {"exclusive": (44664.2, 24684.4, 13617.1, 29.6, 34.1),
        "rr/none": (-34.3, -52.6, -51.5, -10.3, -17.2), "magm/none": (-29.5, -50.3, -46.7, -0.4, -8.9),
        "lug/none": (-30.6, -52.7, -49.7, -0.9, -10.0), "ff/oracle": (-30.7, -51.8, -46.7, 5.0, -6.4),
        "bf/oracle": (-30.7, -51.8, -46.7, 5.0, -6.4), "magm/oracle": (-31.9, -54.1, -49.9, 2.6, -8.1),
        "lug/oracle": (-31.9, -54.1, -49.9, 2.6, -8.1)},
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
    Exclusive. Missed, and pinned as missed so that a change shows: MAGM is not the shortest of RR, MAGM
    and LUG here; RR is, then LUG, then MAGM."""
    targets = [t for t in json.loads((data_dir(None) / "carma_targets.json").read_text())["targets"] if t["trace"] == 2]
    assert all("change_pct" not in t and "change_pct_range" not in t for t in targets)  # no number for trace 2
    assert {(t["policy"], t["metric"]) for t in targets} == {
        ("magm", "makespan"), ("all collocating", "makespan"), ("magm", "energy")}
    t2 = table[2]
    assert all(v[0] < 0 for k, v in t2.items() if k != "exclusive")
    assert t2["magm/none"][3] < 0 and t2["magm/none"][4] < 0  # linear and sublinear energy
    order = sorted(("rr/none", "magm/none", "lug/none"), key=lambda run: t2[run][0])
    assert order == ["rr/none", "lug/none", "magm/none"]


def test_the_assumed_classes_miss_trace_1_by_more_than_5_points():
    """Why the fit exists: with the assumed classes RR gains half of what CARMA measured."""
    t1 = calibrated_table("classes")[1]
    assert t1["rr/none"][0] > -30.6 + 5 and t1["lug/none"][0] > -35.2 + 5


if __name__ == "__main__":
    print(json.dumps(calibrated_table()))
