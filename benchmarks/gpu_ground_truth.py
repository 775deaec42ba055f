"""Ground truth on a real NVIDIA GPU for gpu-estimate, and the comparison with its CPU-side estimate.

Two halves, run on two machines:

``measure`` (on a machine with a GPU and a CUDA build of PyTorch) runs every workload of the accuracy
benchmark (benchmarks/estimator_accuracy.py), the examples and the real-script corpus
(benchmarks/estimator_real_scripts.py) on the GPU, unmodified, for the same iterations gpu-estimate captures
(3 optimizer steps; backward passes for a script without a ``torch.optim`` optimizer; the whole run for one
with neither), and records ``torch.cuda.max_memory_reserved()``, ``max_memory_allocated()`` and the peak of
NVML's per-process ``usedGpuMemory`` (what nvidia-smi shows for the process; read through the project's own
NVML backend, polled every few milliseconds, and once more by the process itself after its last step). It also
probes what lives outside the caching allocator: the CUDA context, and what the first GEMM (cuBLAS), the first
convolution (cuDNN), a GEMM on a second thread and a backward pass add. Workloads run a few at a time, which
per-process NVML readings allow.

``compare`` (on any machine with the CPU build) runs ``gpu-estimate --json --gpu TARGET`` on the same
workloads and prints the table: estimate, measured, signed error.

``caps`` (here) writes, per workload, the environment a time-sliced shared job would get from the agent for
the need the submit hook derives from that estimate (estimate + default margin; gpushare.node.caps and
framework_caps); ``measure --caps caps.json`` then runs each workload under it, so a row says whether the
job completes inside its framework cap and whether its whole-process peak stays inside its need (what the
backstop compares).

    python benchmarks/gpu_ground_truth.py measure --out gt.json [--jobs 4] [--only TEXT] [--caps caps.json]
    python benchmarks/gpu_ground_truth.py compare gt.json [--gpu h200-141gb]
    python benchmarks/gpu_ground_truth.py caps --out caps.json [--gpu h200-141gb] [--only TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 1 << 20
STEPS = 3  # what gpu-estimate captures by default
POLL_S = 0.004


def workloads() -> list[dict[str, Any]]:
    """(label, script, args, cwd) of every workload the estimator's benchmarks use."""
    sys.path.insert(0, HERE)
    import estimator_accuracy
    import estimator_real_scripts

    out: list[dict[str, Any]] = []
    for label, args, _mib, _src in estimator_accuracy.ROWS:
        out.append({"label": label, "group": "accuracy", "script": estimator_accuracy.WORKLOAD, "args": args,
                    "cwd": os.path.dirname(estimator_accuracy.WORKLOAD), "needs": []})
    examples = os.path.join(ROOT, "examples")
    for name in sorted(os.listdir(examples)):
        if name.endswith(".py") and name != "crash.py":  # crash.py fails on purpose
            out.append({"label": name, "group": "examples", "script": os.path.join(examples, name), "args": [],
                        "cwd": examples, "needs": []})
    for name, (_style, needs) in estimator_real_scripts.SCRIPTS.items():
        out.append({"label": name, "group": "real_scripts", "script": os.path.join(estimator_real_scripts.CORPUS, name),
                    "args": [], "cwd": estimator_real_scripts.CORPUS, "needs": needs})
    return out


# --------------------------------------------------------------------------------------------- measure

# Runs inside the child, on the GPU: counts iterations as gpu-estimate does (estimator_cli/phases.py) and,
# at the stop, writes the allocator's peaks and its own NVML reading, then leaves at once.
_CHILD = r"""
import atexit, json, os, runpy, sys, threading, time
import torch
from torch.optim import optimizer as optimizer_mod

out_path, steps, script = sys.argv[1], int(sys.argv[2]), sys.argv[3]
state = {"steps": 0, "backwards": 0, "optimizer": False, "done": False}
history = os.environ.pop("GPUSHARE_GT_HISTORY", "")
if history:  # every allocation from the first, without stack traces (benchmarks/allocator_gaps.py reads it)
    torch.cuda.memory._record_memory_history(context=None, max_entries=4_000_000)

def own_nvml():
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid():
                return p.usedGpuMemory
    except Exception as exc:
        return repr(exc)
    return None

def finish(reason):
    if state["done"]:
        return
    state["done"] = True
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        doc = {"reason": reason, "max_reserved": torch.cuda.max_memory_reserved(),
               "max_allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.memory_reserved(),
               "nvml_self": own_nvml()}
        stats = torch.cuda.memory_stats()
        doc["stats"] = {k: stats.get(k) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                                  "segment.all.peak", "segment.large_pool.peak",
                                                  "segment.small_pool.peak", "reserved_bytes.large_pool.peak",
                                                  "reserved_bytes.small_pool.peak", "inactive_split_bytes.all.peak")}
        if history:
            import pickle
            with open(history + ".tmp", "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
            os.replace(history + ".tmp", history)
    else:
        doc = {"reason": reason, "error": "CUDA never initialised"}
    doc.update(steps=state["steps"], backwards=state["backwards"])
    with open(out_path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(out_path + ".tmp", out_path)

def post_step(opt, args, kwargs):
    state["optimizer"] = True
    state["steps"] += 1
    if state["steps"] >= steps:
        finish("steps")
        time.sleep(0.2)  # the parent's poller reads the final usage
        os._exit(0)

def pre_step(opt, args, kwargs):
    state["optimizer"] = True

optimizer_mod.register_optimizer_step_pre_hook(pre_step)
optimizer_mod.register_optimizer_step_post_hook(post_step)
_init = optimizer_mod.Optimizer.__init__

def init(self, *a, **k):  # with an optimizer, backward passes are never counted (gradient accumulation)
    state["optimizer"] = True
    _init(self, *a, **k)

optimizer_mod.Optimizer.__init__ = init

def counting(fn):
    def wrapper(*a, **k):
        if not state["optimizer"] and threading.current_thread() is threading.main_thread():
            if state["backwards"] >= steps:
                finish("backwards")
                time.sleep(0.2)
                os._exit(0)
            state["backwards"] += 1
        return fn(*a, **k)
    return wrapper

torch.Tensor.backward = counting(torch.Tensor.backward)
atexit.register(finish, "exit")
sys.argv = [script] + sys.argv[4:]
sys.path.insert(0, os.path.dirname(script))
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit:
    pass
finish("exit")
"""

_CONTEXT_PROBE = r"""
import json, os, sys, threading
import torch, torch.nn as nn
import pynvml

pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
def nvml():
    torch.cuda.synchronize()
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
        if p.pid == os.getpid():
            return p.usedGpuMemory
    return None
rows = []
def stage(name):
    used = nvml()
    free, total = torch.cuda.mem_get_info()
    rows.append({"stage": name, "nvml_used": used, "reserved": torch.cuda.memory_reserved(),
                 "device_used": total - free})
torch.cuda.init(); x = torch.zeros(1, device="cuda"); stage("context + 1 tensor")
a = torch.randn(1024, 1024, device="cuda"); (a @ a).sum().item(); stage("+ fp32 GEMM (cuBLAS)")
b = a.bfloat16(); (b @ b).float().sum().item(); stage("+ bf16 GEMM (cuBLASLt)")
conv = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16)).cuda()
conv(torch.randn(8, 3, 64, 64, device="cuda")).sum().item(); stage("+ conv + batchnorm (cuDNN)")
t = threading.Thread(target=lambda: (a @ a).sum().item()); t.start(); t.join(); stage("+ GEMM on a 2nd thread")
m = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 62 * 62, 10)).cuda()
m(torch.randn(8, 3, 64, 64, device="cuda")).sum().backward(); stage("+ backward (autograd thread)")
print(json.dumps(rows))
"""


class NvmlPoller:
    """Peak per-process usage of the watched pids, through the project's own NVML backend."""

    def __init__(self) -> None:
        from gpushare.gres.nvml_backend import NvmlBackend

        self.backend = NvmlBackend()
        self.peaks: dict[int, int] = {}
        self.watched: set[int] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.samples = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for proc in self.backend.processes(0):
                with self.lock:
                    if proc.pid in self.watched and isinstance(proc.used_bytes, int):
                        self.peaks[proc.pid] = max(self.peaks.get(proc.pid, 0), proc.used_bytes)
            self.samples += 1
            time.sleep(POLL_S)

    def watch(self, pid: int) -> None:
        with self.lock:
            self.watched.add(pid)

    def peak(self, pid: int) -> int | None:
        with self.lock:
            self.watched.discard(pid)
            return self.peaks.pop(pid, None)


def run_one(work: dict[str, Any], poller: NvmlPoller, timeout: float,
            caps: dict[str, Any] | None = None, history_dir: str = "") -> dict[str, Any]:
    import importlib.util

    missing = [p for p in work["needs"] if importlib.util.find_spec(p) is None]
    if missing:
        return {**work, "status": "skipped", "error": "needs " + ", ".join(missing)}
    fd, out_path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    os.unlink(out_path)
    cmd = [sys.executable, "-c", _CHILD, out_path, str(STEPS), work["script"], *work["args"]]
    start = time.monotonic()
    env = {**os.environ, **(caps or {}).get("env", {})}
    if history_dir:
        from allocator_gaps import history_name

        env["GPUSHARE_GT_HISTORY"] = os.path.join(history_dir, history_name(work["label"]))
    proc = subprocess.Popen(cmd, cwd=work["cwd"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    poller.watch(proc.pid)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    took = time.monotonic() - start
    peak = poller.peak(proc.pid)
    result: dict[str, Any] = {**work, "seconds": round(took, 1), "exit": proc.returncode, "nvml_peak": peak}
    if caps:
        result["caps"] = caps
        result["oom"] = "OutOfMemoryError" in (err or "") or "CUDA out of memory" in (err or "")
    if os.path.exists(out_path):
        with open(out_path) as f:
            result.update(json.load(f))
        os.unlink(out_path)
        self_read = result.get("nvml_self")
        if isinstance(self_read, int):
            result["nvml_peak"] = max(peak or 0, self_read)
        result["status"] = "ok" if "max_reserved" in result else "failed"
    else:
        result["status"] = "failed"
        result["error"] = (err or "").strip().splitlines()[-1:] or ["(no output)"]
    return result


def measure(opts: argparse.Namespace) -> int:
    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "gpu": torch.cuda.get_device_name(0), "cudnn": torch.backends.cudnn.version()}
    try:
        import pynvml

        pynvml.nvmlInit()
        env["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:  # the report says so rather than failing
        env["driver"] = repr(exc)
    probe = subprocess.run([sys.executable, "-c", _CONTEXT_PROBE], capture_output=True, text=True, timeout=120)
    context = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else probe.stderr[-800:]
    print(json.dumps({"env": env, "context": context}, indent=1), flush=True)
    history = os.path.abspath(opts.history) if opts.history else ""
    if history:
        os.makedirs(history, exist_ok=True)
    poller = NvmlPoller()
    only = [o for o in opts.only.split(",") if o]
    todo = [w for w in workloads() if not only or any(o in w["label"] for o in only)]
    caps_by_label: dict[str, Any] = {}
    if opts.caps:
        with open(opts.caps) as f:
            caps_by_label = json.load(f)
        todo = [w for w in todo if w["label"] in caps_by_label]
    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(opts.jobs) as pool:
        for result in pool.map(lambda w: run_one(w, poller, opts.timeout, caps_by_label.get(w["label"]), history),
                               todo):
            results.append(result)
            print(f"{result['label']:<28} {result['status']:<8} {result.get('seconds', 0):6.1f}s "
                  f"reserved {result.get('max_reserved', 0) / MiB:8.0f} MiB "
                  f"nvml {(result.get('nvml_peak') or 0) / MiB:8.0f} MiB  {result.get('reason', '')} "
                  f"{result.get('error', '')}"
                  + (f" need {result['caps']['need_mib']} MiB oom {result['oom']}" if "caps" in result else ""),
                  flush=True)
            _write(opts.out, {"env": env, "context": context, "poll_samples": poller.samples, "workloads": results})
    poller.stop.set()
    return 0


def _write(path: str, doc: dict[str, Any]) -> None:
    """After every workload, so a run cut short still leaves what it measured."""
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)


# --------------------------------------------------------------------------------------------- compare

def estimate(work: dict[str, Any], gpu: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "gpushare.estimator_cli.cli", "--json", "--no-cache", "--gpu", gpu,
           work["script"], *work["args"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work["cwd"], check=False, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["(no message)"])[-1][:160])
    return json.loads(proc.stdout)


def compare(opts: argparse.Namespace) -> int:
    with open(opts.measured) as f:
        measured = json.load(f)
    here = {w["label"]: w for w in workloads()}
    print(f"GPU: {measured['env']}")
    print("| workload | estimate (MiB) | NVML peak (MiB) | error | est. reserved | max_memory_reserved | error "
          "| max_memory_allocated | mode |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    total_err, reserved_err = [], []
    for row in measured["workloads"]:
        if opts.only and opts.only not in row["label"]:
            continue
        if row["status"] != "ok" or row["label"] not in here:
            print(f"| {row['label']} | | | | | | | | {row['status']}: {row.get('error', '')} |")
            continue
        try:
            doc = estimate(here[row["label"]], opts.gpu)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"| {row['label']} | | {row['nvml_peak'] / MiB:.0f} | | | {row['max_reserved'] / MiB:.0f} | | "
                  f"{row['max_allocated'] / MiB:.0f} | estimate failed: {exc} |")
            continue
        t = doc["targets"][0]
        est_total, est_reserved = t["peak_total_bytes"], t["peak_reserved_bytes"]
        nvml = row["nvml_peak"]
        e_total = (est_total - nvml) / nvml if nvml else None
        e_res = (est_reserved - row["max_reserved"]) / row["max_reserved"] if row["max_reserved"] else None
        if e_total is not None:
            total_err.append(e_total)
        if e_res is not None:
            reserved_err.append(e_res)
        print(f"| {row['label']} | {est_total / MiB:.0f} | {nvml / MiB:.0f} | {_pct(e_total)} | "
              f"{est_reserved / MiB:.0f} | {row['max_reserved'] / MiB:.0f} | {_pct(e_res)} | "
              f"{row['max_allocated'] / MiB:.0f} | {doc['mode']} |", flush=True)
    for name, errs in (("total (NVML)", total_err), ("reserved", reserved_err)):
        if errs:
            print(f"\n{name}: rows {len(errs)}, median |error| {statistics.median(abs(e) for e in errs):.1%}, "
                  f"median error {statistics.median(errs):+.1%}, under-estimates {sum(e < 0 for e in errs)}")
    return 0


def caps(opts: argparse.Namespace) -> int:
    """The framework-cap environment each workload would run under as a shared job (estimate + margin)."""
    from gpushare.node.caps import decide_caps, need_mib
    from gpushare.node.framework_caps import merged_exports
    from gpushare.config import load_config
    from gpushare.cuda_context import context_bytes_for, sm_arch_of
    from gpushare.estimator_cli.recommend import margin_for
    from gpushare.gpus import BUILTIN_GPUS, GiB

    gpu = BUILTIN_GPUS[opts.gpu]
    policy = load_config().policy
    out: dict[str, Any] = {}
    only = [o for o in opts.only.split(",") if o]
    for work in workloads():
        if only and not any(o in work["label"] for o in only):
            continue
        try:
            doc = estimate(work, opts.gpu)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"{work['label']}: estimate failed: {exc}", file=sys.stderr)
            continue
        total = doc["targets"][0]["peak_total_bytes"]
        est_gib, margin_gib = round(total / GiB, 2), round(margin_for(total, policy) / GiB, 2)
        need = need_mib(est_gib, margin_gib, None)
        decided = decide_caps("fraction", shared=True, gpus=1, uid=0, need=need, gpu_total_bytes=gpu.total_bytes,
                              tenants=[], outside_allocator_bytes=context_bytes_for(sm_arch_of(gpu.name)))
        out[work["label"]] = {"est_gib": est_gib, "margin_gib": margin_gib, "need_mib": need,
                              "fraction": decided.fraction, "env": merged_exports({}, decided.fraction)}
        print(f"{work['label']:<28} estimate {est_gib:6.2f} GiB + {margin_gib:.2f} -> need {need} MiB, "
              f"fraction {decided.fraction}", flush=True)
    with open(opts.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:+.1%}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="on a GPU machine")
    m.add_argument("--out", required=True)
    m.add_argument("--jobs", type=int, default=4)
    m.add_argument("--timeout", type=float, default=240)
    m.add_argument("--only", default="", help="comma-separated parts of workload labels")
    m.add_argument("--caps", default="", help="run each workload under the environment from `caps`")
    m.add_argument("--history", default="", help="folder for each workload's recorded allocation history "
                   "(torch.cuda.memory._snapshot(); benchmarks/allocator_gaps.py reads it)")
    c = sub.add_parser("compare", help="gpu-estimate against a measure file")
    c.add_argument("measured")
    c.add_argument("--gpu", default="h200-141gb")
    c.add_argument("--only", default="")
    k = sub.add_parser("caps", help="the shipped framework caps of each workload, from its estimate")
    k.add_argument("--out", required=True)
    k.add_argument("--gpu", default="h200-141gb")
    k.add_argument("--only", default="")
    opts = parser.parse_args()
    return {"measure": measure, "compare": compare, "caps": caps}[opts.command](opts)


if __name__ == "__main__":
    sys.exit(main())
