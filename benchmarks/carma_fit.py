"""Fit the solo SMACT of each utilisation class to CARMA's measured makespans on its trace 1 (``--util carma-fit``).

    python benchmarks/carma_fit.py [--top 5]

Reproduces ``workload.CARMA_FIT_SMACT`` from the committed data: CARMA's trace 1 as run
(simulator/data/carma_trace1.csv) on its server (1 node x 3 A100-40GB), trace seed 0, and the four makespan
statements CARMA's text makes for it (simulator/data/carma_targets.json): RR -30.6 %, LUG -35.2 %, MAGM
"closely following" (the interval between the two; no error inside it) and the best oracle run "up to
-36 %". A grid over light 0.10-0.25, medium 0.40-0.60, heavy 0.60-0.85 in steps of 0.05 (SMOCC and DRAMA
keep their ratios to SMACT, as in ``workload.UTIL_PROFILES``), least squares over the four errors in
percentage points. Ties (equal error to 0.01 point²) go to the candidate closest to the assumed classes.

Only trace 1 is fitted. The script then prints, with the chosen values fixed, the out-of-sample checks:
trace 2 against what CARMA states for it (directions only: every collocating run shorter than Exclusive,
MAGM's energy below Exclusive's, MAGM the shortest of RR, MAGM and LUG), CARMA's energy statement for
trace 1 (-12 to -15 %, not fitted), CARMA's latest revision (makespan up to -35 %, energy up to -15 %),
and the same table for the shipped values, so that a grid that finds a
different optimum shows beside them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpushare.simulator import report, trace, workload  # noqa: E402
from gpushare.simulator.cli import THROUGHPUTS_NAME, data_dir  # noqa: E402
from gpushare.simulator.engine import SimConfig  # noqa: E402
from gpushare.simulator.runner import simulation  # noqa: E402

GRID = {"light": (0.10, 0.15, 0.20, 0.25), "medium": (0.40, 0.45, 0.50, 0.55, 0.60),
        "heavy": (0.60, 0.65, 0.70, 0.75, 0.80, 0.85)}
RECOVERY_ONLY = ("rr", "magm", "lug")
ORACLE = ("ff", "bf", "magm", "lug")


def profile(smact: dict[str, float]) -> dict[str, tuple[float, float, float]]:
    """SMACT per class -> (SMACT, SMOCC, DRAMA), the ratios of the assumed classes kept."""
    base = workload.UTIL_CLASSES
    return {k: (s, s * base[k][1] / base[k][0], s * base[k][2] / base[k][0]) for k, s in smact.items()}


def changes(number: int, smact: dict[str, float]) -> dict[str, tuple[float, float]]:
    """Trace ``number``: per run, (makespan, sublinear energy) change against Exclusive, %."""
    data = data_dir(None)
    jobs = trace.read(data / f"carma_trace{number}.csv", seed=0)
    name = "_fit_candidate"
    workload.UTIL_PROFILES[name] = profile(smact)
    try:
        def run(policy: str, estimator: str) -> dict[str, Any]:
            config = SimConfig(policy=policy, estimator=estimator, throughputs=data / THROUGHPUTS_NAME, util=name)
            return report.summarise(simulation(jobs, config).run())

        base = run("exclusive", "oracle")
        out = {}
        for policy, estimator in [(p, "none") for p in RECOVERY_ONLY] + [(p, "oracle") for p in ORACLE]:
            got = run(policy, estimator)
            out[f"{policy}/{estimator}"] = (100 * (got["makespan_s"] / base["makespan_s"] - 1),
                                            100 * (got["energy_sublinear_mj"] / base["energy_sublinear_mj"] - 1))
        return out
    finally:
        del workload.UTIL_PROFILES[name]


def targets() -> list[dict[str, Any]]:
    return json.loads((data_dir(None) / "carma_targets.json").read_text())["targets"]


def errors(t1: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Trace 1's makespan errors against CARMA's four statements, in points (0 inside a stated interval)."""
    got = {"rr": t1["rr/none"][0], "lug": t1["lug/none"][0], "magm": t1["magm/none"][0],
           "best oracle": min(v[0] for k, v in t1.items() if k.endswith("/oracle"))}
    out = {}
    for target in targets():
        if target["trace"] != 1 or target["metric"] != "makespan":
            continue
        lo, hi = target.get("change_pct_range") or (target["change_pct"], target["change_pct"])
        value = got[target["policy"]]
        out[target["policy"]] = value - hi if value > hi else value - lo if value < lo else 0.0
    return out


def fit() -> list[tuple[float, dict[str, float], dict[str, float]]]:
    """Every grid point as (sum of squared errors, SMACT per class, errors), best first."""
    assumed = {k: v[0] for k, v in workload.UTIL_CLASSES.items()}
    scored = []
    for light, medium, heavy in itertools.product(GRID["light"], GRID["medium"], GRID["heavy"]):
        smact = {"light": light, "medium": medium, "heavy": heavy}
        err = errors(changes(1, smact))
        distance = sum((smact[k] - assumed[k]) ** 2 for k in smact)
        scored.append((round(sum(e * e for e in err.values()), 2), distance, smact, err))
    scored.sort(key=lambda row: (row[0], row[1]))
    return [(sse, smact, err) for sse, _, smact, err in scored]


def checks(smact: dict[str, float]) -> dict[str, Any]:
    """Out-of-sample: trace 1's energy and trace 2's three directions, the fit fixed."""
    t1, t2 = changes(1, smact), changes(2, smact)
    order = sorted(RECOVERY_ONLY, key=lambda p: t2[f"{p}/none"][0])
    return {
        "t1 energy sublinear, recovery only (CARMA -12 to -15 %)": {p: round(t1[f"{p}/none"][1], 1)
                                                                    for p in RECOVERY_ONLY},
        "t2 makespan, every collocating run shorter than Exclusive": all(v[0] < 0 for v in t2.values()),
        "t2 MAGM energy below Exclusive": t2["magm/none"][1] < 0,
        "t2 MAGM shortest of rr, magm, lug": order[0] == "magm",
        "t2 makespan, recovery only": {p: round(t2[f"{p}/none"][0], 1) for p in RECOVERY_ONLY},
        # CARMA's latest revision, abstract: "for the best-performing collocation policy", makespan -35 %, energy -15 %
        "t1 best recovery-only makespan (revision: up to -35 %)": round(min(t1[f"{p}/none"][0] for p in RECOVERY_ONLY), 1),
        "t1 best recovery-only energy, sublinear (revision: up to -15 %)":
            round(min(t1[f"{p}/none"][1] for p in RECOVERY_ONLY), 1),
    }


def share_of_best(seeds: list[int], release: str = "22.05") -> dict[int, list[tuple[int, float, float, str]]]:
    """Per CARMA trace: per seed, live's makespan gain (shipped defaults) as a share of the best CARMA policy's
    (MAGM, LUG, FF, BF with the oracle estimator, RR without one), with the shipped calibrated values."""
    from gpushare.config import parse_config
    from gpushare.simulator.live import setup

    data = data_dir(None)
    live = setup(parse_config({}), release)
    runs = (("magm", "oracle"), ("lug", "oracle"), ("rr", "none"), ("ff", "oracle"), ("bf", "oracle"))
    out: dict[int, list[tuple[int, float, float, str]]] = {}
    for number in (1, 2):
        out[number] = []
        for seed in seeds:
            jobs = trace.read(data / f"carma_trace{number}.csv", seed=seed)

            def span(**kw: Any) -> float:
                config = SimConfig(throughputs=data / THROUGHPUTS_NAME, seed=seed, util="carma-fit", **kw)
                return float(report.summarise(simulation(jobs, config).run())["makespan_s"])

            base = span(policy="exclusive", estimator="none")
            best = min((span(policy=p, estimator=e), p) for p, e in runs)
            mine = span(policy="live", estimator="measured", caps=live.caps, recovery=live.recovery, live=live)
            out[number].append((seed, 100 * (mine / base - 1), 100 * (best[0] / base - 1), best[1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=5, help="grid points to print, best first")
    parser.add_argument("--seeds", type=int, default=5, help="trace seeds 0..N-1 for live's share of the best")
    args = parser.parse_args()
    print(f"live (shipped defaults, 22.05) on CARMA's traces, trace seeds 0-{args.seeds - 1}: makespan change "
          "against Exclusive and its share of the best CARMA policy's gain\n")
    for number, rows in share_of_best(list(range(args.seeds))).items():
        shares = [mine / top for _, mine, top, _ in rows]
        for seed, mine, top, name in rows:
            print(f"  T{number} seed {seed}: live {mine:+.1f} %, best {top:+.1f} % ({name}), {mine / top:.0%} of the best")
        print(f"  T{number}: mean {sum(shares) / len(shares):.0%}, range {min(shares):.0%}-{max(shares):.0%}\n")
    ranked = fit()
    print(f"grid: {len(ranked)} points, fitted on CARMA's trace 1 (makespan errors in points)\n")
    print("| rank | light | medium | heavy | SSE | RR | LUG | MAGM | best oracle |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rank, (sse, smact, err) in enumerate(ranked[: args.top], 1):
        print(f"| {rank} | {smact['light']:.2f} | {smact['medium']:.2f} | {smact['heavy']:.2f} | {sse:.2f} | "
              f"{err['rr']:+.1f} | {err['lug']:+.1f} | {err['magm']:+.1f} | {err['best oracle']:+.1f} |")
    shipped = dict(workload.CARMA_FIT_SMACT)
    for rank, (sse, smact, _) in enumerate(ranked, 1):
        if all(abs(smact[k] - shipped[k]) < 1e-9 for k in shipped):
            print(f"\nshipped {shipped}: rank {rank} of {len(ranked)}, SSE {sse:.2f}")
    best = ranked[0][1]
    print(f"fitted: {best}; reproduces the shipped values: "
          f"{all(abs(best[k] - shipped[k]) < 1e-9 for k in shipped)}\n")
    for label, smact in (("fitted", best), ("shipped", shipped)):
        print(f"out-of-sample checks, {label} {smact}:")
        for key, value in checks(smact).items():
            print(f"  {key}: {value}")


if __name__ == "__main__":
    main()
