"""The do-no-harm and published-gains benchmarks on a small trace: the rows they print are the runs they name;
the calibration's fit (benchmarks/carma_fit.py) on a grid of two points.

Why: docs/benchmarks.md quotes these scripts' tables; the shard placement of each 24.11+ row must be the
one its label says (advised: first-fit with ``queued``; least-loaded where ``LL_SHARED_GRES`` is named).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import carma_fit  # noqa: E402
import do_no_harm  # noqa: E402
import simulator_published  # noqa: E402


def _rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|\n").split("|")] for line in text.splitlines()
            if line.startswith("| 1.0 |")]


def test_do_no_harm_rows_follow_the_advised_placement(capsys):
    do_no_harm.table(60, 16, [1.0], ["22.05", "24.11"], [0], 1)
    rows = {tuple(r[1:5]): r[5:] for r in _rows(capsys.readouterr().out)}
    assert ("22.05", "queued", "off", "first-fit") in rows
    assert ("24.11+", "always", "off", "least-loaded") in rows
    assert ("24.11+", "queued", "off", "least-loaded") in rows  # a site that keeps LL_SHARED_GRES
    # the release changes nothing but the shard placement: 24.11+ as advised is 22.05's run
    assert rows[("24.11+", "queued", "off", "first-fit")] == rows[("22.05", "queued", "off", "first-fit")]
    assert rows[("24.11+", "queued", "on", "first-fit")] == rows[("22.05", "queued", "on", "first-fit")]


def test_do_no_harm_runs_the_shipped_defaults_under_either_utilisation_model(capsys):
    assert do_no_harm.main(["--jobs", "60", "--gpus", "16", "--loads", "1.0", "--releases", "22.05", "--seeds", "0",
                            "--workers", "1", "--util", "classes", "--shipped-only"]) == 0
    out = capsys.readouterr().out
    assert "--util classes" in out
    assert [tuple(r[1:5]) for r in _rows(out)] == [("Exclusive", "", "", ""), ("22.05", "queued", "off", "first-fit")]


def test_published_gains_print_beside_the_closest_setting(capsys):
    assert simulator_published.main(["--jobs", "30", "--seeds", "0", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "| Gimbal (ACM TACO 2025) | section 7.2, Figure 8 | Lucid + Gimbal | Lucid |" in out
    assert "| gimbal-free -> gimbal-jct-runtime | mean JCT |" in out and "1.28x (Lucid)" in out
    assert "| exclusive -> gimbal-jct-runtime | mean JCT |" in out and "3.75x (Slurm, Alibaba)" in out


def test_carma_fit_scores_every_trace_1_statement_on_a_reduced_grid(capsys, monkeypatch):
    """The fit's objective is every number CARMA states for trace 1: four makespan terms and one energy term
    per recovery-only run (sublinear power), in points, zero inside a stated range. The shipped values'
    errors are the calibrated table's (tests/simulator/test_carma_calibration.py, PINNED[1]) against the
    targets: RR -29.2 against -30.6, LUG -33.0 against -35.2, MAGM -33.8 inside [-35.2, -30.6], the best
    oracle -38.9 against -36; energy RR -16.4 beyond -15, MAGM -13.0 inside [-15, -12], LUG -11.7 above -12."""
    grid = {"light": (0.15,), "medium": (0.55,), "heavy": (0.65, 0.85)}
    ranked = carma_fit.fit(grid, workers=1)
    assert len(ranked) == 2 and ranked[0]["sse"] <= ranked[1]["sse"]
    shipped = next(row for row in ranked if row["smact"] == dict(carma_fit.workload.CARMA_FIT_SMACT))
    expected = {"rr": 1.4, "lug": 2.2, "magm": 0.0, "best oracle": -2.9,
                "energy rr": -1.4, "energy magm": 0.0, "energy lug": 0.3}
    assert shipped["errors"] == {k: pytest.approx(v, abs=0.11) for k, v in expected.items()}
    assert shipped["sse"] == pytest.approx(sum(e * e for e in shipped["errors"].values()), abs=0.01)
    assert shipped["sse_makespan"] < shipped["sse"]  # the energy term counts
    monkeypatch.setattr(carma_fit, "GRID", grid)
    assert carma_fit.main(["--seeds", "0", "--workers", "1", "--top", "2", "--check"]) == 0
    out = capsys.readouterr().out
    assert "grid: 2 points" in out and "| energy RR | energy MAGM | energy LUG |" in out
    assert "revision: best recovery-only makespan -35 %" in out
    assert 'to ship (simulator/workload.py): CARMA_FIT_SMACT = {"light": 0.15, "medium": 0.55, "heavy": 0.65}' in out


@pytest.mark.slow
def test_the_shipped_calibration_is_the_fits_optimum_among_its_grid_neighbours(capsys, monkeypatch):
    """What ships is what the committed fit gives (benchmarks/carma_fit.py on CARMA's trace 1): no point of the
    fit's grid within one step of the shipped values in any class scores better (the whole grid's optimum is
    also its block's; ``carma_fit.py --check`` runs the whole grid). And ``--check`` refuses values that are
    not the optimum."""
    shipped = dict(carma_fit.workload.CARMA_FIT_SMACT)
    block = carma_fit.neighbourhood(shipped)
    assert all(len(v) == 3 for v in block.values()), block  # not at the grid's edge: a neighbour on every side
    ranked = carma_fit.fit(block, workers=1)
    assert ranked[0]["smact"] == shipped, [(r["smact"], r["sse"]) for r in ranked[:3]]
    monkeypatch.setattr(carma_fit.workload, "CARMA_FIT_SMACT", {"light": 0.20, "medium": 0.45, "heavy": 0.70})
    monkeypatch.setattr(carma_fit, "GRID", {"light": (0.15, 0.20), "medium": (0.45,), "heavy": (0.70,)})
    assert carma_fit.main(["--seeds", "0", "--workers", "1", "--check"]) == 1
    assert "the fit reproduces the shipped values: False" in capsys.readouterr().out
