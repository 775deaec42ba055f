"""Interference and power of training jobs sharing one real GPU, for the simulator's calibration.

    python benchmarks/gpu_pairs.py [--seconds 10] [--out results.json]       # on a GPU machine
    python benchmarks/gpu_pairs.py --device cpu --seconds 1                  # a dry run of the harness

Three workloads of the simulator's three utilisation classes, written out here so nothing is downloaded:
``light`` a small CNN on 32x32 images, ``medium`` torchvision's ResNet-50 at 224x224, ``heavy`` a BERT-base
sized encoder (transformers' BertForSequenceClassification from its default configuration, random weights)
at sequence length 128. Each runs alone, then in pairs as two processes on one GPU, time-sliced (the
default) and, where ``nvidia-cuda-mps-control`` exists, under MPS. Every process warms up first and starts
its timed window together with its partner, so the windows overlap.

Per run: median step time of each process, the GPU's SM activity (NVML GPM ``SM_UTIL`` on Hopper, else
NVML's kernel-time utilisation, named as such), mean power and the energy counter's joules over the window;
idle power before anything runs. Printed as a table and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

KINDS = ("light", "medium", "heavy")
PAIRS = (("light", "heavy"), ("medium", "heavy"), ("heavy", "heavy"), ("medium", "medium"))


# --- the workloads (one process each) ------------------------------------------------------------------
def make_step(kind: str, device: str):  # type: ignore[no-untyped-def]
    """A closure running one optimiser step of ``kind`` on ``device``."""
    import torch
    from torch import nn

    if kind == "light":
        model: nn.Module = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 8 * 8, 10))
        inputs = (torch.randn(128, 3, 32, 32, device=device),)
        target = torch.randint(0, 10, (128,), device=device)
    elif kind == "medium":
        import torchvision

        model = torchvision.models.resnet50(num_classes=1000)
        batch = 64 if device != "cpu" else 2
        inputs = (torch.randn(batch, 3, 224, 224, device=device),)
        target = torch.randint(0, 1000, (batch,), device=device)
    else:
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig() if device != "cpu" else BertConfig(num_hidden_layers=1, hidden_size=64,
                                                                 num_attention_heads=2, intermediate_size=128)
        bert = BertForSequenceClassification(config)
        batch, length = (32, 128) if device != "cpu" else (2, 16)
        ids = torch.randint(0, config.vocab_size, (batch, length), device=device)
        model = bert
        inputs = (ids,)
        target = torch.randint(0, 2, (batch,), device=device)
    model = model.to(device)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        optimiser.zero_grad(set_to_none=True)
        out = model(*inputs)
        logits = out.logits if hasattr(out, "logits") else out
        loss_fn(logits, target).backward()
        optimiser.step()
        if device != "cpu":
            torch.cuda.synchronize()

    return step


def worker(kind: str, device: str, seconds: float, ready: Path, go: Path, result: Path) -> int:
    step = make_step(kind, device)
    for _ in range(5):  # warm-up: cuDNN/cuBLAS choices, the caching allocator's pools
        step()
    ready.touch()
    while not go.exists():
        time.sleep(0.01)
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    result.write_text(json.dumps({"kind": kind, "steps": len(times), "median_s": statistics.median(times)}))
    return 0


# --- the GPU's view (NVML) -----------------------------------------------------------------------------
class Meter:
    """Power and SM activity sampled every 100 ms in a thread; the energy counter read at both ends."""

    def __init__(self, device: str) -> None:
        self.nvml: Any = None
        self.handle: Any = None
        self.activity_source = "none"
        if device == "cpu":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.name = pynvml.nvmlDeviceGetName(self.handle)
            self.activity_source = "gpm_sm_util" if self._gpm_sm_util(0.05) is not None else "nvml_util_gpu"
        except Exception as exc:  # noqa: BLE001 - a dry run or an old driver: say so in the output
            print(f"NVML unavailable: {exc}", file=sys.stderr)
            self.nvml = None

    def _gpm_sm_util(self, window_s: float) -> float | None:
        """SM activity in per cent over ``window_s`` from GPM (Hopper and later), or None."""
        try:
            n = self.nvml
            first, second = n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc()
            try:
                n.nvmlGpmSampleGet(self.handle, first)
                time.sleep(window_s)
                n.nvmlGpmSampleGet(self.handle, second)
                request = n.c_nvmlGpmMetricsGet_t()
                request.version = n.NVML_GPM_METRICS_GET_VERSION
                request.numMetrics = 1
                request.sample1, request.sample2 = first, second
                request.metrics[0].metricId = n.NVML_GPM_METRIC_SM_UTIL
                n.nvmlGpmMetricsGet(request)
                return float(request.metrics[0].value)
            finally:
                n.nvmlGpmSampleFree(first)
                n.nvmlGpmSampleFree(second)
        except Exception:  # noqa: BLE001 - not on this GPU or this nvidia-ml-py
            return None

    def measure(self, seconds: float) -> dict[str, Any]:
        if self.nvml is None:
            time.sleep(seconds)
            return {}
        n, handle = self.nvml, self.handle
        power: list[float] = []
        activity: list[float] = []
        stop = threading.Event()

        def sample_power() -> None:
            while not stop.is_set():
                power.append(n.nvmlDeviceGetPowerUsage(handle) / 1000.0)
                if self.activity_source == "nvml_util_gpu":
                    activity.append(float(n.nvmlDeviceGetUtilizationRates(handle).gpu))
                stop.wait(0.1)

        energy_before = n.nvmlDeviceGetTotalEnergyConsumption(handle)
        thread = threading.Thread(target=sample_power, daemon=True)
        thread.start()
        end = time.monotonic() + seconds
        while time.monotonic() < end - 0.6:
            if self.activity_source == "gpm_sm_util":
                value = self._gpm_sm_util(0.5)
                if value is not None:
                    activity.append(value)
            else:
                time.sleep(0.5)
        while time.monotonic() < end:
            time.sleep(0.05)
        stop.set()
        thread.join()
        joules = (n.nvmlDeviceGetTotalEnergyConsumption(handle) - energy_before) / 1000.0
        return {"power_w": round(statistics.mean(power), 1) if power else None,
                "sm_activity_pct": round(statistics.mean(activity), 1) if activity else None,
                "energy_j": round(joules, 1), "window_s": seconds}


# --- the runs -------------------------------------------------------------------------------------------
def run(kinds: tuple[str, ...], device: str, seconds: float, meter: Meter, env: dict[str, str]) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="gpu-pairs-"))
    go = folder / "go"
    procs = []
    for index, kind in enumerate(kinds):
        argv = [sys.executable, __file__, "--worker", kind, "--device", device, "--seconds", str(seconds),
                "--ready", str(folder / f"ready{index}"), "--go", str(go), "--result", str(folder / f"r{index}.json")]
        procs.append(subprocess.Popen(argv, env=env))
    deadline = time.monotonic() + 180
    while not all((folder / f"ready{i}").exists() for i in range(len(kinds))):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                p.kill()
            return {"kinds": list(kinds), "error": "a worker did not get ready"}
        time.sleep(0.05)
    go.touch()
    gpu = meter.measure(seconds)
    for p in procs:
        p.wait(timeout=seconds + 120)
    results = [json.loads((folder / f"r{i}.json").read_text()) for i in range(len(kinds))
               if (folder / f"r{i}.json").exists()]
    shutil.rmtree(folder, ignore_errors=True)
    return {"kinds": list(kinds), "workers": results, **gpu}


def start_mps(env: dict[str, str]) -> dict[str, str] | None:
    control = shutil.which("nvidia-cuda-mps-control")
    if not control:
        return None
    base = Path(tempfile.mkdtemp(prefix="mps-"))
    mps_env = {**env, "CUDA_MPS_PIPE_DIRECTORY": str(base / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(base / "log")}
    (base / "pipe").mkdir()
    (base / "log").mkdir()
    if subprocess.run([control, "-d"], env=mps_env).returncode != 0:
        return None
    return mps_env


def stop_mps(mps_env: dict[str, str]) -> None:
    control = shutil.which("nvidia-cuda-mps-control")
    if control:
        subprocess.run([control], input=b"quit\n", env=mps_env, timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="timed window of each run")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    parser.add_argument("--no-mps", action="store_true")
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--ready", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--go", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.device, args.seconds, args.ready, args.go, args.result)
    meter = Meter(args.device)
    env = dict(os.environ)
    report: dict[str, Any] = {"gpu": getattr(meter, "name", args.device), "activity": meter.activity_source,
                              "idle": meter.measure(3.0), "alone": [], "time_sliced": [], "mps": []}
    for kind in KINDS:
        report["alone"].append(run((kind,), args.device, args.seconds, meter, env))
        print(json.dumps(report["alone"][-1]), flush=True)
    for pair in PAIRS:
        report["time_sliced"].append(run(pair, args.device, args.seconds, meter, env))
        print(json.dumps(report["time_sliced"][-1]), flush=True)
    mps_env = None if args.no_mps or args.device == "cpu" else start_mps(env)
    report["mps_available"] = mps_env is not None
    if mps_env is not None:
        try:
            for pair in PAIRS:
                report["mps"].append(run(pair, args.device, args.seconds, meter, mps_env))
                print(json.dumps(report["mps"][-1]), flush=True)
        finally:
            stop_mps(mps_env)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
