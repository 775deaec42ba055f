"""The hard cap shim under real CUDA programs on a real GPU: PyTorch's allocators, two processes, CuPy, step time.

Why: the shim's tests run over a fake driver; what a site cares about is whether real frameworks, with their
own allocators, stop cleanly at the share and how much a training step pays for the interposition. Run as
root on a machine with an NVIDIA GPU and gcc (no Slurm needed: the job's cgroup and limits folder are given
through the shim's test build, ``-DHARDCAP_TESTING``):

    python benchmarks/hardcap_gpu.py --share-mib 4096 --out hardcap_gpu.json

Each check is a child process under ``LD_PRELOAD`` with the framework environment the agent gives a shared
job (``gpushare.node.caps``: PyTorch's fraction of the whole GPU, for the share less what a process holds
outside the allocator), and once more without it:

* PyTorch's default caching allocator, ``expandable_segments:True`` and ``backend:cudaMallocAsync``: 64 MiB
  tensors until the first out-of-memory; what ``torch.cuda.mem_get_info`` shows; whose error it was;
* two processes of one job on one budget: each takes 256 MiB blocks in turn until refused; their sum;
* CuPy's memory pool (when CuPy is installed) the same way;
* step time of a small convolutional network's training step, 60 steps, with and without the shim (median of
  the last 40), and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MiB = 1 << 20

_GROW = r"""
import json, os, subprocess, sys, torch
kind = sys.argv[1]
free, total = torch.cuda.mem_get_info()
held, err = [], ""
try:
    while True:
        held.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
except Exception as exc:  # torch.OutOfMemoryError or a CUDA error: which one is the finding
    err = type(exc).__name__ + ": " + str(exc).splitlines()[0][:160]
torch.cuda.synchronize()
smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                     capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
nvml = [int(line.split(",")[1]) for line in smi.stdout.splitlines() if line.split(",")[0].strip() == str(os.getpid())]
print(json.dumps({"kind": kind, "total_mib": total >> 20, "free_mib": free >> 20, "held_mib": len(held) * 64,
                  "max_reserved_mib": torch.cuda.max_memory_reserved() >> 20, "nvml_used_mib": nvml[:1],
                  "error": err}))
"""

_TWO = r"""
import json, sys, time
import torch
turn, count, path = int(sys.argv[1]), 0, sys.argv[2]
held = []
torch.cuda.init()
deadline = time.time() + 60
while time.time() < deadline:
    try:
        held.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
        count += 1
    except Exception:
        break
    time.sleep(0.05)
print(json.dumps({"process": turn, "held_mib": count * 256}))
"""

_CUPY = r"""
import json
try:
    import cupy
except ImportError:
    print(json.dumps({"skipped": "no cupy"}))
    raise SystemExit(0)
held, err = [], ""
try:
    while True:
        held.append(cupy.empty(64 << 20, dtype=cupy.uint8))
except Exception as exc:
    err = type(exc).__name__ + ": " + str(exc).splitlines()[0][:160]
free, total = cupy.cuda.runtime.memGetInfo()
print(json.dumps({"held_mib": len(held) * 64, "total_mib": total >> 20, "error": err}))
"""

_STEP = r"""
import json, time, torch, torch.nn as nn
torch.backends.cudnn.benchmark = False
m = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10)).cuda()
opt = torch.optim.SGD(m.parameters(), lr=0.01)
x, y = torch.randn(64, 3, 64, 64, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
times = []
for _ in range(60):
    t = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(m(x), y).backward()
    opt.step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
print(json.dumps({"steps_s": times[20:]}))
"""


def build_shim(out: Path) -> Path:
    shim = out / "hardcap.so"
    subprocess.run(["gcc", "-O2", "-DHARDCAP_TESTING", "-fPIC", "-shared", "-o", str(shim),
                    str(ROOT / "gres/hardcap/hardcap.c"), "-ldl", "-lpthread"], check=True)
    return shim


def context_charge_mib() -> int:
    """The shim's per-process context charge the Prolog writes for this GPU (gpushare.node.hardcap.context_charge:
    gpushare.cuda_context's figure for the GPU's generation, named by its marketing name as NVML reports it)."""
    import torch

    from gpushare.cuda_context import context_bytes_for, sm_arch_of

    return context_bytes_for(sm_arch_of("", torch.cuda.get_device_name(0))) // MiB


def job_dirs(base: Path, share_mib: int, job: int) -> dict[str, str]:
    """A limits folder and a cgroup file for job ``job``: what the Prolog and slurmstepd would give it."""
    limits = base / "limits" / f"job_{job}"
    limits.mkdir(parents=True, exist_ok=True)
    (limits / "gpu0").write_text(f"{share_mib * MiB} {context_charge_mib() * MiB}\n")
    cgroup = base / f"cgroup.{job}"
    cgroup.write_text(f"0::/system.slice/slurmstepd.scope/job_{job}/step_0\n")
    return {"GPUSHARE_HARDCAP_DIR": str(base / "limits"), "GPUSHARE_HARDCAP_CGROUP": str(cgroup)}


def framework_env(share_mib: int) -> dict[str, str]:
    """PyTorch's fraction as the agent exports it for a shared job: of the whole GPU (the device's total)."""
    import torch

    from gpushare.node.caps import allocator_fraction
    from gpushare.node.framework_caps import fraction_text, merged_exports
    from gpushare.cuda_context import context_bytes_for, sm_arch_of

    total = torch.cuda.get_device_properties(0).total_memory
    outside = context_bytes_for(sm_arch_of("", torch.cuda.get_device_name(0)))
    fraction = allocator_fraction(share_mib * MiB - outside, total)
    return {"GPUSHARE_MEMORY_FRACTION": fraction_text(fraction), **merged_exports({}, fraction)}


def child(code: str, args: list[str], env: dict[str, str], timeout: float = 180) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"failed": proc.returncode, "stderr": proc.stderr.strip().splitlines()[-3:]}
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--share-mib", type=int, default=4096)
    parser.add_argument("--out", default="hardcap_gpu.json")
    parser.add_argument("--allocators-only", action="store_true", help="only PyTorch's three allocators")
    opts = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="hardcap-gpu-"))
    shim = build_shim(base)
    fw = framework_env(opts.share_mib)
    results: dict[str, Any] = {"share_mib": opts.share_mib, "context_charge_mib": context_charge_mib(), "framework": fw}
    plain = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF")}
    capped = {**plain, **job_dirs(base, opts.share_mib, 41), "LD_PRELOAD": str(shim)}
    for name, conf in (("default allocator", ""), ("expandable_segments", "expandable_segments:True"),
                       ("cudaMallocAsync", "backend:cudaMallocAsync")):
        env = {**capped, **fw}
        alloc_conf = ",".join(x for x in (fw.get("PYTORCH_CUDA_ALLOC_CONF", ""), conf) if x)
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
        results[name] = {"alloc_conf": alloc_conf, **child(_GROW, [name], env)}
        results[name + ", no framework fraction"] = child(
            _GROW, [name], {**capped, "PYTORCH_CUDA_ALLOC_CONF": conf} if conf else capped)
        print(name, results[name], flush=True)
    if opts.allocators_only:
        Path(opts.out).write_text(json.dumps(results, indent=1))
        return 0
    two = {**plain, **job_dirs(base, opts.share_mib, 42), "LD_PRELOAD": str(shim)}
    procs = [subprocess.Popen([sys.executable, "-c", _TWO, str(i), str(base)], env=two, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    held = [json.loads(o.splitlines()[-1]) if o.strip() else {"stderr": e[-300:]} for o, e in outs]
    results["two processes, one budget"] = {"processes": held,
                                            "sum_mib": sum(h.get("held_mib", 0) for h in held)}
    print("two", results["two processes, one budget"], flush=True)
    results["cupy"] = child(_CUPY, [], {**plain, **job_dirs(base, opts.share_mib, 43), "LD_PRELOAD": str(shim)})
    print("cupy", results["cupy"], flush=True)
    steps: dict[str, float] = {}
    for label, env in (("without shim", plain),
                       ("with shim", {**plain, **job_dirs(base, 16384, 44), "LD_PRELOAD": str(shim)})):
        runs = [child(_STEP, [], env) for _ in range(3)]
        samples = [t for r in runs for t in r.get("steps_s", [])]
        steps[label] = statistics.median(samples) if samples else float("nan")
    results["step_time_ms"] = {k: round(v * 1e3, 4) for k, v in steps.items()}
    results["step_time_ratio"] = round(steps["with shim"] / steps["without shim"], 4)
    print("steps", results["step_time_ms"], results["step_time_ratio"], flush=True)
    Path(opts.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
