"""Where an estimate's reserved memory differs from a real GPU's: the allocator model or the captured trace.

Why: an estimate can be off for two different reasons, and they need different fixes. Either the allocations
the estimator captured on the CPU differ from what the script allocates on the GPU (a cuDNN workspace of
another size, a kernel that keeps a buffer), or the same allocations land in a different number of bytes
reserved (the caching-allocator model: rounding, splitting, segment sizes, caching across streams). Both
sides can be split apart with PyTorch's own record of every allocation:

* on the GPU, ``gpu_ground_truth.py measure --history DIR`` runs each workload with
  ``torch.cuda.memory._record_memory_history`` on and writes ``torch.cuda.memory._snapshot()`` at the stop;
* here, this script reads that record, **replays the real allocation trace through the allocator model**
  (error = the model's alone), and compares the real trace with the one ``gpu-estimate --snapshot`` captures
  on the CPU (error = the capture's), naming the allocation sizes live at the real peak that the capture
  lacks or has in excess; the last two columns are the estimate itself (``peak_reserved_bytes`` of
  ``gpu-estimate --json``) against the real ``max_memory_reserved``, both errors together.

    python benchmarks/allocator_gaps.py gt.json --history DIR [--gpu h200-141gb] [--only TEXT]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


def history_name(label: str) -> str:
    """The file name of a workload's recorded history: its label with anything but [A-Za-z0-9._-] as '_'."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in label) + ".pickle"


def trace_of(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """The recorded actions of device 0 (the only one the workloads use)."""
    traces = snapshot.get("device_traces") or [[]]
    return list(traces[0])


def events(trace: Iterable[dict[str, Any]]) -> Iterator[tuple[str, int, int, int]]:
    """The trace as the allocator model's replay events: a block's address is its key until it is freed.

    ``free_completed`` (not ``free_requested``) is when PyTorch makes a block reusable: a block recorded on
    another stream waits for that stream's events in between.
    """
    for entry in trace:
        action = entry["action"]
        if action == "alloc":
            yield ("alloc", entry["addr"], entry["size"], entry["stream"])
        elif action == "free_completed":
            yield ("free", entry["addr"], 0, entry["stream"])
        elif action == "oom":
            return


def live_at_peak(trace: Iterable[dict[str, Any]]) -> tuple[int, collections.Counter[int]]:
    """The peak of allocated bytes and the sizes of the blocks live at it (size -> count)."""
    live: dict[int, int] = {}
    now = peak = 0
    at_peak: dict[int, int] = {}
    for entry in trace:
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry["size"]
            now += entry["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif entry["action"] == "free_completed":
            now -= live.pop(entry["addr"], 0)
    return peak, collections.Counter(at_peak.values())


def segments(trace: Iterable[dict[str, Any]]) -> tuple[int, int]:
    """How many segments were cudaMalloc'd, and their bytes, over the run."""
    count = total = 0
    for entry in trace:
        if entry["action"] in ("segment_alloc", "segment_map"):
            count += 1
            total += entry["size"]
    return count, total


def size_class(size: int) -> str:
    return f"{size / MiB:.1f} MiB" if size >= MiB else f"{size // 1024} KiB"


def differences(real: collections.Counter[int], captured: collections.Counter[int], top: int = 3) -> str:
    """The size classes (rounded to 1 MiB, or 1 KiB below it) with the largest byte differences at the peaks."""
    def by_class(counts: collections.Counter[int]) -> collections.Counter[int]:
        out: collections.Counter[int] = collections.Counter()
        for size, n in counts.items():
            unit = MiB if size >= MiB else 1024
            out[round(size / unit) * unit] += size * n
        return out

    r, c = by_class(real), by_class(captured)
    diff = sorted(((r[k] - c[k], k) for k in set(r) | set(c) if r[k] != c[k]), key=lambda d: -abs(d[0]))
    return "; ".join(f"{'+' if d > 0 else '-'}{abs(d) / MiB:.0f} MiB of {size_class(k)}" for d, k in diff[:top])


def capture(work: dict[str, Any], gpu: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``gpu-estimate --json --snapshot`` on one workload: (the estimate document, its snapshot)."""
    fd, path = tempfile.mkstemp(suffix=".pickle")
    os.close(fd)
    try:
        cmd = [sys.executable, "-m", "gpushare.estimator_cli.cli", "--json", "--no-cache", "--gpu", gpu,
               "--snapshot", path, work["script"], *work["args"]]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work["cwd"], check=False, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError((proc.stderr.strip().splitlines() or ["(no message)"])[-1][:160])
        with open(path, "rb") as f:
            return json.loads(proc.stdout), pickle.load(f)
    finally:
        os.unlink(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("measured", help="the JSON that `gpu_ground_truth.py measure --history DIR` wrote")
    parser.add_argument("--history", required=True, help="the folder of recorded histories")
    parser.add_argument("--gpu", default="h200-141gb")
    parser.add_argument("--only", default="", help="comma-separated parts of workload labels")
    opts = parser.parse_args()

    sys.path.insert(0, HERE)
    import gpu_ground_truth

    from gpushare.estimator_cli.allocator import AllocatorConfig, replay
    from gpushare.gpus import BUILTIN_GPUS

    capacity = BUILTIN_GPUS[opts.gpu].total_bytes
    here = {w["label"]: w for w in gpu_ground_truth.workloads()}
    with open(opts.measured) as f:
        measured = json.load(f)
    only = [o for o in opts.only.split(",") if o]
    print("| workload | real reserved | model on real trace | model error | real peak allocated | captured peak "
          "allocated | capture error | real segments | captured segments | live at the real peak, real − captured "
          "| estimated reserved | estimate error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for row in measured["workloads"]:
        label = row["label"]
        path = os.path.join(opts.history, history_name(label))
        if (only and not any(o in label for o in only)) or not os.path.exists(path) or label not in here:
            continue
        with open(path, "rb") as f:
            real_trace = trace_of(pickle.load(f))
        modelled = replay(events(real_trace), capacity, AllocatorConfig())
        real_reserved = row["max_reserved"]
        real_peak, real_live = live_at_peak(real_trace)
        real_segs, real_seg_bytes = segments(real_trace)
        try:
            doc, snap = capture(here[label], opts.gpu)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"| {label} | {real_reserved / MiB:.0f} | {modelled.peak_reserved_bytes / MiB:.0f} | | "
                  f"{real_peak / MiB:.0f} | | | {real_segs} | | capture failed: {exc} |")
            continue
        cap_trace = trace_of(snap)
        cap_peak, cap_live = live_at_peak(cap_trace)
        cap_segs, _ = segments(cap_trace)
        model_err = (modelled.peak_reserved_bytes - real_reserved) / real_reserved
        cap_err = (cap_peak - real_peak) / real_peak if real_peak else 0.0
        estimated = doc["targets"][0]["peak_reserved_bytes"]
        print(f"| {label} | {real_reserved / MiB:.0f} | {modelled.peak_reserved_bytes / MiB:.0f} | {model_err:+.1%} | "
              f"{real_peak / MiB:.0f} | {cap_peak / MiB:.0f} | {cap_err:+.1%} | {real_segs} ({real_seg_bytes / MiB:.0f} MiB) "
              f"| {cap_segs} | {differences(real_live, cap_live)} | {estimated / MiB:.0f} "
              f"| {(estimated - real_reserved) / real_reserved:+.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
