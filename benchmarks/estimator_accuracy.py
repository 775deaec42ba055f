"""Accuracy of gpu-estimate against published real-GPU peak memory measurements.

Ground truth rows (each cites its source):
- CARMA (Yousefzadeh-Asl-Miandoab et al., CARMA paper, appendix Table 2; per-run values from
  the authors' artifact itu-rad/CARMA ``workloads/ehsan-summary.csv``, column "Max memory.used [MB]",
  i.e. nvidia-smi MiB *including* the CUDA context): A100-SXM4-40GB, PyTorch 2.7.1, CUDA 13.0.
  Workloads reproduced by ``benchmarks/estimator_workloads/carma_vision.py``.
- xMem's per-run ground truth (which excludes the context) is not reproduced here: the paper's text has
  only aggregate errors (Fig. 7–9) and its per-run data could not be obtained in this environment.

Metrics: relative error of ``peak_total_bytes`` (nvidia-smi equivalent) per row, the median absolute
relative error, the share of under-estimates, and the share still under once the configured margin
(``[policy] margin_fraction``/``margin_min_gib``) is added, which is what the submit hook requests.

    python benchmarks/estimator_accuracy.py [--mode fake] [--rows resnet50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOAD = os.path.join(HERE, "estimator_workloads", "carma_vision.py")
MiB = 1 << 20
CARMA_SRC = "CARMA Table 2 / itu-rad/CARMA workloads/ehsan-summary.csv"

# (label, workload args, measured nvidia-smi MiB, source)
ROWS = [
    ("resnet50 bs32", ["--model", "resnet50", "--batch_size", "32"], 3934, CARMA_SRC),
    ("resnet50 bs64", ["--model", "resnet50", "--batch_size", "64"], 7106, CARMA_SRC),
    ("resnet50 bs128", ["--model", "resnet50", "--batch_size", "128"], 13236, CARMA_SRC),
    ("vgg16 bs32", ["--model", "vgg16", "--batch_size", "32"], 6684, CARMA_SRC),
    ("vgg16 bs64", ["--model", "vgg16", "--batch_size", "64"], 11760, CARMA_SRC),
    ("vgg16 bs128", ["--model", "vgg16", "--batch_size", "128"], 21864, CARMA_SRC),
    ("mobilenet_v2 bs32", ["--model", "mobilenet_v2", "--batch_size", "32"], 3352, CARMA_SRC),
    ("mobilenet_v2 bs64", ["--model", "mobilenet_v2", "--batch_size", "64"], 6032, CARMA_SRC),
    ("mobilenet_v2 bs128", ["--model", "mobilenet_v2", "--batch_size", "128"], 11336, CARMA_SRC),
] + [
    (f"{m}-cifar100 bs{bs}", ["--model", m, "--batch_size", str(bs), "--image_size", "32", "--num_classes", "100",
                              "--optimizer", "adamw"], mib, CARMA_SRC)
    for m, values in (("resnet18", (788, 796, 858)), ("resnet34", (1002, 1016, 1074)))
    for bs, mib in zip((32, 64, 128), values)
]


def estimate(args: list[str], mode: str, gpu: str) -> dict:
    cmd = [sys.executable, "-m", "gpushare.estimator_cli.cli", "--json", "--no-cache", "--mode", mode, "--gpu", gpu,
           WORKLOAD, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"gpu-estimate failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="auto", choices=["auto", "fake", "profile"])
    parser.add_argument("--gpu", default="a100-40gb")
    parser.add_argument("--rows", default="", help="only rows whose label contains this text")
    opts = parser.parse_args()
    sys.path.insert(0, os.path.dirname(HERE))
    from gpushare.estimator_cli.warm_worker import private_runtime

    with private_runtime("gpushare-bench-runtime-"):  # gpu-estimate's warm worker: ours, stopped at the end
        return _table(opts)


def _table(opts: argparse.Namespace) -> int:
    from gpushare.estimator_cli.recommend import margin_for
    from gpushare.config import load_config

    policy = load_config().policy
    errors, under, under_margin = [], 0, 0
    print(f"{'workload':<22} {'measured':>9} {'estimate':>9} {'reserved':>9} {'context':>8} {'error':>7} "
          f"{'+margin':>8}  mode   time  source")
    for label, args, measured_mib, source in ROWS:
        if opts.rows and opts.rows not in label:
            continue
        start = time.monotonic()
        doc = estimate(args, opts.mode, opts.gpu)
        took = time.monotonic() - start
        t = doc["targets"][0]
        measured = measured_mib * MiB
        est = t["peak_total_bytes"]
        err = (est - measured) / measured
        with_margin = est + margin_for(est, policy)
        errors.append(err)
        under += est < measured
        under_margin += with_margin < measured
        print(f"{label:<22} {measured_mib:>7} M {est / MiB:>7.0f} M {t['peak_reserved_bytes'] / MiB:>7.0f} M "
              f"{t['context_bytes'] / MiB:>6.0f} M {err:>+7.1%} {(with_margin - measured) / measured:>+8.1%}  "
              f"{doc['mode']:<6} {took:4.1f}s  {source}")
    n = len(errors)
    print(f"\nrows: {n}  median |error|: {statistics.median(abs(e) for e in errors):.1%}  "
          f"median error: {statistics.median(errors):+.1%}  under-estimates: {under}/{n} ({under / n:.0%})  "
          f"under after margin: {under_margin}/{n} ({under_margin / n:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
