"""Speed of gpu-estimate: fake mode against profile mode on the same scripts, in one run.

Scripts: ``examples/resnet50_train.py`` (ResNet-50, Adam) and ``examples/gpt2_train.py --preset gpt2-small
--seq-len 1024`` (GPT-2 small, AdamW), 3 optimizer steps, batch 32 and 256, target a100-80gb, no cache.
Fake mode is run ``--repeats`` times and the median reported; profile mode runs once per case with the
given time and memory limits (real CPU execution: it may not finish, which is then reported as such).
Wall time is that of the whole ``gpu-estimate`` process (interpreter and torch import included);
``elapsed_s`` is the estimator's own figure (child start to report); CPU is the user+system seconds the
process and its child consumed (``getrusage(RUSAGE_CHILDREN)``), which a loaded machine inflates less.

    python benchmarks/estimator_speed.py [--repeats 3] [--profile-timeout 300]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [
    ("ResNet-50", os.path.join(ROOT, "examples", "resnet50_train.py"), []),
    ("GPT-2 small", os.path.join(ROOT, "examples", "gpt2_train.py"), ["--preset", "gpt2-small", "--seq-len", "1024"]),
]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(script: str, args: list[str], mode: str, timeout: float, memory: str
            ) -> tuple[float, dict | None, str, float]:
    cmd = [sys.executable, "-m", "estimator_cli.cli", "--json", "--no-cache", "--mode", mode, "--gpu", "a100-80gb",
           "--timeout", str(timeout), "--max-cpu-memory", memory, script, *args]
    start, cpu = time.monotonic(), _children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    wall, cpu = time.monotonic() - start, _children_cpu() - cpu
    if proc.returncode != 0:
        return wall, None, f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[0][:90]}", cpu
    return wall, json.loads(proc.stdout), "", cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-timeout", type=float, default=300.0)
    parser.add_argument("--profile-memory", default="16G")
    parser.add_argument("--batches", default="32,256")
    opts = parser.parse_args()
    print(f"cpus: {os.cpu_count()}  load average at start: {os.getloadavg()[0]:.1f}")
    print(f"{'case':<12} {'batch':>5} {'fake wall':>10} {'fake CPU':>9} {'elapsed_s':>10} {'profile wall':>13} "
          f"{'profile CPU':>12} {'ratio wall/CPU':>15}  peak reserved fake/profile")
    for name, script, extra in CASES:
        for batch in (int(b) for b in opts.batches.split(",")):
            args = [*extra, "--batch-size", str(batch)]
            fakes = [one_run(script, args, "fake", 600, "16G") for _ in range(opts.repeats)]
            walls = [w for w, doc, _, _ in fakes if doc]
            cpus = [c for _, doc, _, c in fakes if doc]
            docs = [doc for _, doc, _, _ in fakes if doc]
            if not docs:
                print(f"{name:<12} {batch:>5} fake failed: {fakes[0][2]}")
                continue
            fake_wall, fake_cpu = statistics.median(walls), statistics.median(cpus)
            fake_elapsed = statistics.median(d["elapsed_s"] for d in docs)
            p_wall, p_doc, p_err, p_cpu = one_run(script, args, "profile", opts.profile_timeout, opts.profile_memory)
            fake_peak = docs[0]["targets"][0]["peak_reserved_bytes"] / 2**30
            if p_doc:
                ratio = f"{p_wall / fake_wall:5.1f}x/{p_cpu / fake_cpu:4.1f}x"
                prof = f"{p_wall:11.1f} s {p_cpu:10.1f} s"
                peaks = f"{fake_peak:.2f} / {p_doc['targets'][0]['peak_reserved_bytes'] / 2**30:.2f} GiB"
            else:
                ratio = f">{p_wall / fake_wall:4.1f}x/>{p_cpu / fake_cpu:3.1f}x" if "exit 4" in p_err else "n/a"
                prof = f"{'(' + p_err[:26] + ')':>26}"
                peaks = f"{fake_peak:.2f} GiB / —"
            print(f"{name:<12} {batch:>5} {fake_wall:>8.1f} s {fake_cpu:>7.1f} s {fake_elapsed:>8.1f} s {prof} "
                  f"{ratio:>15}  {peaks}", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
