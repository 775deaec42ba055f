"""OOM forecaster benchmark: lead time, false positives and missed OOMs on simulated growth patterns.

Run: ``python benchmarks/forecaster.py [--seeds 50] [--horizons 60,120]``

Replays 1 Hz device-memory series of five shapes (``gpushare.simulator.growth``: steady, step, leak,
plateau, noisy; 30 minutes each, cap 20 GiB, parameters drawn per seed) through the agent's forecaster
(``gpushare.policy.forecast``, MIGM §3.2.3) and prints one markdown table per horizon. Everything is seeded.
"""

from __future__ import annotations

import argparse
import time

from gpushare.policy.forecast import ForecastConfig
from gpushare.simulator.growth import table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--horizons", default="60,120")
    args = parser.parse_args()
    for horizon in (float(h) for h in args.horizons.split(",")):
        cfg = ForecastConfig(horizon_s=horizon)
        started = time.perf_counter()
        text = table(args.seeds, cfg)
        print(f"\nhorizon {horizon:.0f} s, window {cfg.window} samples, confirm {cfg.confirm}, "
              f"z {cfg.z} ({time.perf_counter() - started:.1f} s)\n")
        print(text)


if __name__ == "__main__":
    main()
