"""Speed of gpu-estimate: fake mode against profile mode on the same scripts, in one run.

Scripts: ``examples/resnet50_train.py`` (ResNet-50, Adam) and ``examples/gpt2_train.py --preset gpt2-small
--seq-len 1024`` (GPT-2 small, AdamW), 3 optimizer steps, batch 32 and 256, target a100-80gb, no cache.
Fake mode is run ``--repeats`` times each way and the median reported: *cold* (``--no-warm``: a fresh
interpreter imports torch for every estimate) and *warm* (the capture is forked by the user's warm
worker, estimator_cli/warm_worker.py; one unmeasured run starts it first). Profile mode runs once per
case, cold, with the given time and memory limits (real CPU execution: it may not finish, which is then
reported as such). Wall time is that of the whole ``gpu-estimate`` process; CPU (cold only) is the
user+system seconds the process and its child consumed (``getrusage(RUSAGE_CHILDREN)``), which a loaded
machine inflates less; a warm child is the worker's, not ours, so it has no CPU column. The warm
worker lives in a private runtime directory and is stopped at the end.

    python benchmarks/estimator_speed.py [--repeats 5] [--profile-timeout 300]

Latency guard (``--guard``): only ``examples/resnet50_train.py`` at its defaults, target a100-80gb, no cache,
``--repeats`` cold and warm runs; prints both medians (and the warm gpu-estimate process's own CPU seconds)
beside the committed baseline, ``benchmarks/results/estimator_latency_baseline.json``, and exits 1 when
the warm median, or the warm gpu-estimate process's CPU seconds, is more than twice the baseline's.
``--write-baseline`` records this machine's medians instead (on a quiet machine: the load average is printed
and stored with them).

    python benchmarks/estimator_speed.py --guard [--repeats 5] [--write-baseline]
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
BASELINE = os.path.join(ROOT, "benchmarks", "results", "estimator_latency_baseline.json")
GUARD_FACTOR = 2.0  # the guard fails when warm latency doubles
CASES = [
    ("ResNet-50", os.path.join(ROOT, "examples", "resnet50_train.py"), []),
    ("GPT-2 small", os.path.join(ROOT, "examples", "gpt2_train.py"), ["--preset", "gpt2-small", "--seq-len", "1024"]),
]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(script: str, args: list[str], mode: str, timeout: float, memory: str, warm: bool = False
            ) -> tuple[float, dict | None, str, float]:
    cmd = [sys.executable, "-m", "gpushare.estimator_cli.cli", "--json", "--no-cache", "--mode", mode, "--gpu", "a100-80gb",
           "--timeout", str(timeout), "--max-cpu-memory", memory, *([] if warm else ["--no-warm"]), script, *args]
    start, cpu = time.monotonic(), _children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    wall, cpu = time.monotonic() - start, _children_cpu() - cpu
    if proc.returncode != 0:
        return wall, None, f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[0][:90]}", cpu
    return wall, json.loads(proc.stdout), "", cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile-timeout", type=float, default=300.0)
    parser.add_argument("--profile-memory", default="16G")
    parser.add_argument("--batches", default="32,256")
    parser.add_argument("--guard", action="store_true", help="ResNet-50 warm/cold medians against the baseline")
    parser.add_argument("--write-baseline", action="store_true", help="with --guard: record the medians")
    opts = parser.parse_args()
    sys.path.insert(0, ROOT)
    from gpushare.estimator_cli.warm_worker import private_runtime

    with private_runtime("gpushare-bench-runtime-"):  # a worker of our own, whatever the user has running
        return _guard(opts) if opts.guard else _table(opts)


def _guard(opts: argparse.Namespace) -> int:
    """Warm and cold medians of ResNet-50 against the committed baseline; 1 when warm latency doubled."""
    _, script, extra = CASES[0]
    load = os.getloadavg()[0]
    colds = [one_run(script, extra, "fake", 600, "16G") for _ in range(opts.repeats)]
    one_run(script, extra, "fake", 600, "16G", warm=True)  # starts the worker when there is none
    warms = [one_run(script, extra, "fake", 600, "16G", warm=True) for _ in range(opts.repeats)]
    failed = [err for _, doc, err, _ in (*colds, *warms) if doc is None]
    if failed:
        print(f"estimator latency guard: an estimate failed: {failed[0]}")
        return 1
    if any(doc["capture_process"] != "warm" for _, doc, _, _ in warms):
        print("estimator latency guard: the warm worker was not used")
        return 1
    now = {"cold_s": round(statistics.median(w for w, *_ in colds), 2),
           "warm_s": round(statistics.median(w for w, *_ in warms), 2),
           "warm_parent_cpu_s": round(statistics.median(c for *_, c in warms), 2)}
    print(f"cpus: {os.cpu_count()}  load average at start {load:.1f}, at end {os.getloadavg()[0]:.1f}")
    if opts.write_baseline:
        with open(BASELINE, "w", encoding="utf-8") as handle:
            json.dump(dict(now, script="examples/resnet50_train.py", repeats=opts.repeats, load_average=load,
                           load_average_at_end=round(os.getloadavg()[0], 2), measured=time.strftime("%Y-%m-%d")),
                      handle, indent=2)
            handle.write("\n")
        print(f"baseline written: {BASELINE}: {now}")
        return 0
    with open(BASELINE, encoding="utf-8") as handle:
        base = json.load(handle)
    print(f"{'median of ' + str(opts.repeats):<16} {'now':>8} {'baseline':>9} {'ratio':>6}")
    for key in ("warm_s", "cold_s", "warm_parent_cpu_s"):
        print(f"{key:<16} {now[key]:>7.2f}s {base[key]:>8.2f}s {now[key] / base[key]:>5.1f}x")
    failed = False
    if now["warm_s"] > GUARD_FACTOR * base["warm_s"]:
        print(f"FAILED: warm latency {now['warm_s']:.2f} s is more than {GUARD_FACTOR:g}x the baseline's "
              f"{base['warm_s']:.2f} s (baseline load average {base.get('load_average', '?')}, now {load:.1f})")
        failed = True
    if now["warm_parent_cpu_s"] > GUARD_FACTOR * max(base["warm_parent_cpu_s"], 0.1):
        # CPU seconds, which load inflates far less than wall time: the gpu-estimate process's own work
        print(f"FAILED: the warm gpu-estimate process used {now['warm_parent_cpu_s']:.2f} CPU seconds, more than "
              f"{GUARD_FACTOR:g}x the baseline's {base['warm_parent_cpu_s']:.2f} s (does it import torch?)")
        failed = True
    if failed:
        return 1
    print("estimator latency guard: ok")
    return 0


def _table(opts: argparse.Namespace) -> int:
    print(f"cpus: {os.cpu_count()}  load average at start: {os.getloadavg()[0]:.1f}")
    print(f"{'case':<12} {'batch':>5} {'cold wall':>10} {'cold CPU':>9} {'warm wall':>10} {'warm elapsed':>13} "
          f"{'profile wall':>13} {'profile CPU':>12} {'profile/warm':>13}  peak reserved cold/warm/profile")
    for name, script, extra in CASES:
        for batch in (int(b) for b in opts.batches.split(",")):
            args = [*extra, "--batch-size", str(batch)]
            colds = [one_run(script, args, "fake", 600, "16G") for _ in range(opts.repeats)]
            one_run(script, args, "fake", 600, "16G", warm=True)  # starts the worker when there is none
            warms = [one_run(script, args, "fake", 600, "16G", warm=True) for _ in range(opts.repeats)]
            cold_docs = [doc for _, doc, _, _ in colds if doc]
            warm_docs = [doc for _, doc, _, _ in warms if doc and doc["capture_process"] == "warm"]
            if not cold_docs or not warm_docs:
                print(f"{name:<12} {batch:>5} fake failed: {colds[0][2] or warms[0][2] or 'worker not used'}")
                continue
            cold_wall = statistics.median(w for w, doc, _, _ in colds if doc)
            cold_cpu = statistics.median(c for _, doc, _, c in colds if doc)
            warm_wall = statistics.median(w for w, doc, _, _ in warms if doc)
            warm_elapsed = statistics.median(d["elapsed_s"] for d in warm_docs)
            p_wall, p_doc, p_err, p_cpu = one_run(script, args, "profile", opts.profile_timeout, opts.profile_memory)
            peaks = [d["targets"][0]["peak_reserved_bytes"] / 2**30 for d in (cold_docs[0], warm_docs[0])]
            if p_doc:
                ratio = f"{p_wall / warm_wall:11.1f}x"
                prof = f"{p_wall:11.1f} s {p_cpu:10.1f} s"
                peaks.append(p_doc["targets"][0]["peak_reserved_bytes"] / 2**30)
            else:
                ratio = f">{p_wall / warm_wall:10.1f}x" if "exit 4" in p_err else "n/a"
                prof = f"{'(' + p_err[:26] + ')':>26}"
            print(f"{name:<12} {batch:>5} {cold_wall:>8.1f} s {cold_cpu:>7.1f} s {warm_wall:>8.1f} s "
                  f"{warm_elapsed:>11.1f} s {prof} {ratio:>13}  {' / '.join(f'{x:.2f}' for x in peaks)} GiB",
                  flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
