"""Caps and the backstop on a real NVIDIA GPU: what a shared job's limits do on the device itself.

Three checks, each printing what it measured (run on a machine with a GPU; it changes no device setting):

1. *Framework cap*: a job process started with the environment the TaskProlog gives a time-sliced job
   whose need is ``--cap-gib`` (``gpushare.node.caps.decide_caps`` with what the device holds outside the
   allocator, then ``gpushare.node.framework_caps.merged_exports``) loads what a training step loads (cuBLAS
   on two threads, cuDNN) and allocates 256 MiB blocks until
   PyTorch refuses one. It must get PyTorch's own ``OutOfMemoryError`` at its cap, not at the device's size,
   while a neighbour process holds ``--neighbour-gib``.
2. *The agent's view*: the agent's own sampler (``gpushare.agent.sampler.Sampler``) on the NVML backend, with
   both processes tracked as jobs, must attribute each one's device memory to its job, and the backstop
   (``gpushare.agent.backstop.judge``) must find the capped job within its cap + tolerance and a job that
   allocates past its cap without framework caps over it.
3. *MPS*: an MPS control daemon started through ``gpushare.gres.mps.DaemonMps`` (no compute-mode change: the
   GPU stays in its default mode), and a client with ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` from
   ``gpushare.gres.mps.job_env``; the client must fail at its limit. The daemon is stopped at the end.

    python benchmarks/gpu_caps_check.py [--cap-gib 4] [--neighbour-gib 8] [--no-mps]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30
MiB = 1 << 20

# A job process: holds `hold` GiB, or grows in 256 MiB blocks to `grow` GiB (0: until refused); prints one JSON
# line, then waits for a line on stdin so the parent can read NVML while the memory is still held.
_JOB = r"""
import json, sys, torch
hold, grow = float(sys.argv[1]), float(sys.argv[2])
blocks, err = [], None
a = torch.randn(512, 512, device="cuda")  # load what a training step loads: cuBLAS on two threads, cuDNN
import threading
t = threading.Thread(target=lambda: (a @ a).sum().item()); t.start(); t.join()
conv = torch.nn.Conv2d(3, 8, 3).cuda()
conv(torch.randn(2, 3, 32, 32, device="cuda")).sum().backward()
torch.cuda.synchronize()
try:
    if hold:
        blocks.append(torch.empty(int(hold * (1 << 30)), dtype=torch.uint8, device="cuda"))
    while not hold and (not grow or len(blocks) * 256 < grow * 1024):
        blocks.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
except torch.OutOfMemoryError as exc:
    err = str(exc)
except RuntimeError as exc:
    err = "RuntimeError: " + str(exc)
torch.cuda.synchronize()
print(json.dumps({"reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated(),
                  "blocks": len(blocks), "oom": err}), flush=True)
sys.stdin.readline()
"""


def start_job(hold: float, grow: float, env: dict[str, str], job_id: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen([sys.executable, "-c", _JOB, str(hold), str(grow)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env, "SLURM_JOB_ID": job_id})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"job process failed: {proc.stderr.read()[-600:] if proc.stderr else ''}")
    return proc, json.loads(line)


def stop_job(proc: subprocess.Popen[str]) -> None:
    try:
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()


def framework_and_backstop(cap_gib: float, neighbour_gib: float) -> dict[str, Any]:
    from gpushare.agent.backstop import judge
    from gpushare.node.caps import decide_caps
    from gpushare.node.framework_caps import merged_exports
    from gpushare.agent.sampler import Sampler, environ_job
    from gpushare.config import AgentSection
    from gpushare.cuda_context import context_bytes_for, sm_arch_of
    from gpushare.gres.nvml_backend import NvmlBackend

    backend = NvmlBackend()
    info = backend.gpu(0)
    total = info.total_bytes
    need = int(cap_gib * 1024)
    outside = context_bytes_for(sm_arch_of(info.model, info.name))
    caps = decide_caps("fraction", shared=True, gpus=1, uid=os.getuid(), need=need, gpu_total_bytes=total,
                       tenants=[], outside_allocator_bytes=outside)
    env = merged_exports({}, caps.fraction)
    out: dict[str, Any] = {"gpu": info.name, "total_bytes": total, "caps": caps.as_dict(),
                           "outside_allocator_bytes": outside, "env": env}
    neighbour, n_doc = start_job(neighbour_gib, 0, {}, "9001")
    capped, c_doc = start_job(0, 0, env, "9002")
    over, o_doc = start_job(0, cap_gib * 2, {}, "9003")  # no framework caps: the backstop's case
    try:
        out["neighbour"], out["capped"], out["uncapped"] = n_doc, c_doc, o_doc
        sampler = Sampler(backend, pid_job=environ_job)
        cap_bytes = int(cap_gib * GiB)
        for job, pid in (("9001", neighbour.pid), ("9002", capped.pid), ("9003", over.pid)):
            sampler.track({"job": job, "uid": os.getuid(), "gpus": [0], "start": time.time(),
                           "caps": {"mode": "fraction", "mem_limit_mib": cap_bytes >> 20 if job != "9001" else
                                    int(neighbour_gib * 1024 + 1024)}})
        sampler.tick(time.time())
        nvml = {p.pid: p.used_bytes for p in backend.processes(0)}
        agent = AgentSection()
        tol = agent.backstop_tolerance_mib * MiB
        out["agent_view"] = {}
        for job, pid in (("9001", neighbour.pid), ("9002", capped.pid), ("9003", over.pid)):
            acc = sampler.jobs[job]
            seen = acc.now_bytes.get("0", 0.0)
            verdict = judge(seen, acc.cap_bytes, tol, 0.0, time.time(), None)
            out["agent_view"][job] = {"pid": pid, "nvml_bytes": nvml.get(pid), "agent_bytes": seen,
                                      "peak_bytes": acc.peak_bytes.get("0"), "cap_bytes": acc.cap_bytes,
                                      "verdict": verdict.state}
    finally:
        for proc in (neighbour, capped, over):
            stop_job(proc)
        backend.close()
    return out


def mps_check(limit_gib: float) -> dict[str, Any]:
    from gpushare.gres.mps import DaemonMps, job_env

    run_dir = tempfile.mkdtemp(prefix="gpushare-mps-")
    os.chmod(run_dir, 0o755)
    mps = DaemonMps(run_dir)
    out: dict[str, Any] = {}
    try:
        pipe_dir, log_dir = mps.start(0)
        out["daemon_running"] = mps.running(0)
        env = job_env(pipe_dir, 0, int(limit_gib * 1024))
        out["client_env"] = env
        client, doc = start_job(0, limit_gib * 3, env, "9004")
        out["client"] = doc
        out["nvml_processes"] = _nvml_processes()  # what the agent's sampler would read under MPS
        out["client_pid"] = client.pid
        stop_job(client)
        for name in ("control.log", "server.log"):
            path = os.path.join(log_dir, name)
            if os.path.exists(path):
                with open(path) as f:
                    out[name] = f.read()[-1500:]
    except Exception as exc:  # report, then still stop the daemon
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            mps.stop(0)
            out["daemon_stopped"] = not mps.running(0)
        except Exception as exc:
            out["stop_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _nvml_processes() -> list[dict[str, Any]]:
    from gpushare.gres.nvml_backend import NvmlBackend

    backend = NvmlBackend()
    try:
        return [{"pid": p.pid, "used_bytes": p.used_bytes} for p in backend.processes(0)]
    finally:
        backend.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-gib", type=float, default=4.0)
    parser.add_argument("--neighbour-gib", type=float, default=8.0)
    parser.add_argument("--no-mps", action="store_true")
    opts = parser.parse_args()
    result = {"framework_and_backstop": framework_and_backstop(opts.cap_gib, opts.neighbour_gib)}
    print(json.dumps(result, indent=1, default=str), flush=True)
    if not opts.no_mps:
        result["mps"] = mps_check(opts.cap_gib)
        print(json.dumps({"mps": result["mps"]}, indent=1, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
