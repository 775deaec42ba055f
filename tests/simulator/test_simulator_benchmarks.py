"""The do-no-harm and published-gains benchmarks on a small trace: the rows they print are the runs they name.

Why: docs/benchmarks.md quotes these scripts' tables; the shard placement of each 24.11+ row must be the
one its label says (advised: first-fit with ``queued``; least-loaded where ``LL_SHARED_GRES`` is named).
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

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
