"""MPS control: one ``nvidia-cuda-mps-control`` daemon per GPU (or MIG device), its defaults, and the
environment a job needs to become a client with its own caps.

Why per-GPU daemons with their own pipe/log directories: the pipe directory is how a client finds its
daemon, so a job's ``CUDA_MPS_PIPE_DIRECTORY`` pins it to the GPU Slurm gave it, and defaults set on one
GPU's daemon cannot leak to another. Limits set through the control pipe apply to MPS *servers* created
afterwards (one per UID), while the per-client variables below apply to each client at start — so the
TaskProlog exports ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (estimate + margin: a job that outgrows its
estimate fails alone) and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` per job.

Devices are named by a key: the GPU index (``0``) or a MIG device UUID (``MIG-…``); the daemon runs with
``CUDA_VISIBLE_DEVICES=<that device>``, so inside it the device is always ``0``.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from gpushare.gres.errors import GpuError, NvmlCode

if TYPE_CHECKING:
    from gpushare.gres.sim_backend import SimBackend

MPS_CONTROL = "nvidia-cuda-mps-control"
Runner = Callable[[list[str], dict[str, str], "str | None"], "subprocess.CompletedProcess[str]"]


def _slug(device: int | str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(device))


def mps_dirs(run_dir: str | os.PathLike[str], device: int | str) -> tuple[str, str]:
    """(pipe dir, log dir) of the daemon for ``device`` under ``run_dir``."""
    base = Path(run_dir) / f"mps-{_slug(device)}"
    return str(base / "pipe"), str(base / "log")


def job_env(pipe_dir: str, device: int | str, mem_limit_mib: int | None = None,
            thread_percentage: int | None = None) -> dict[str, str]:
    """Variables the TaskProlog exports for an MPS client job (pure).

    ``device`` is how the *job* names its GPU in ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (its index in its
    own CUDA_VISIBLE_DEVICES, usually ``0``, or the GPU/MIG UUID).
    """
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe_dir}
    if mem_limit_mib is not None:
        if mem_limit_mib <= 0:
            raise ValueError(f"MPS memory limit must be positive, got {mem_limit_mib} MiB")
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"{device}={int(mem_limit_mib)}M"
    if thread_percentage is not None:
        if not 1 <= thread_percentage <= 100:
            raise ValueError(f"MPS active thread percentage must be 1..100, got {thread_percentage}")
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(int(thread_percentage))
    return env


class MpsControl(Protocol):
    """What the agent asks of MPS; both implementations are idempotent (start twice = one daemon)."""

    run_dir: str

    def start(self, device: int | str) -> tuple[str, str]: ...  # returns (pipe dir, log dir)
    def stop(self, device: int | str) -> None: ...
    def running(self, device: int | str) -> bool: ...
    def set_default_pinned_mem_limit(self, device: int | str, mib: int) -> None: ...
    def set_default_active_thread_percentage(self, device: int | str, percentage: int) -> None: ...


def _run(cmd: list[str], env: dict[str, str], stdin: str | None) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(cmd, env=env, input=stdin, capture_output=True, text=True, timeout=30, check=False)


class DaemonMps:
    """Real MPS control daemons, driven through ``nvidia-cuda-mps-control`` (``runner`` is injectable)."""

    def __init__(self, run_dir: str, runner: Runner = _run, binary: str = MPS_CONTROL) -> None:
        self.run_dir = run_dir
        self.runner = runner
        self.binary = binary

    def _env(self, device: int | str) -> dict[str, str]:
        pipe, log = mps_dirs(self.run_dir, device)
        return {**os.environ, "CUDA_VISIBLE_DEVICES": str(device), "CUDA_MPS_PIPE_DIRECTORY": pipe,
                "CUDA_MPS_LOG_DIRECTORY": log}

    def _command(self, device: int | str, line: str) -> str:
        try:
            done = self.runner([self.binary], self._env(device), line + "\n")
        except FileNotFoundError:
            raise GpuError(NvmlCode.NOT_SUPPORTED, f"{self.binary} not found: install the CUDA MPS tools") from None
        if done.returncode != 0:
            raise GpuError(NvmlCode.UNKNOWN, f"MPS '{line}' on {device}: {(done.stderr or done.stdout).strip()}")
        return done.stdout

    def running(self, device: int | str) -> bool:
        pipe, _ = mps_dirs(self.run_dir, device)
        if not (Path(pipe) / "control").exists():
            return False
        try:
            self._command(device, "get_server_list")
        except GpuError:
            return False
        return True

    def start(self, device: int | str) -> tuple[str, str]:
        pipe, log = mps_dirs(self.run_dir, device)
        if self.running(device):
            return pipe, log
        for path in (pipe, log):
            Path(path).mkdir(parents=True, exist_ok=True)
        try:
            done = self.runner([self.binary, "-d"], self._env(device), None)
        except FileNotFoundError:
            raise GpuError(NvmlCode.NOT_SUPPORTED, f"{self.binary} not found: install the CUDA MPS tools") from None
        if done.returncode != 0:
            raise GpuError(NvmlCode.UNKNOWN, f"start MPS on {device}: {(done.stderr or done.stdout).strip()}")
        return pipe, log

    def stop(self, device: int | str) -> None:
        if self.running(device):
            self._command(device, "quit")

    def set_default_pinned_mem_limit(self, device: int | str, mib: int) -> None:
        self._command(device, f"set_default_device_pinned_mem_limit 0 {int(mib)}M")

    def set_default_active_thread_percentage(self, device: int | str, percentage: int) -> None:
        self._command(device, f"set_default_active_thread_percentage {int(percentage)}")


class SimMps:
    """MPS control for the simulated backend: the same calls, recorded in the shared state file."""

    def __init__(self, backend: "SimBackend", run_dir: str) -> None:
        self.backend = backend
        self.run_dir = run_dir

    def _entry(self, state: dict[str, Any], device: int | str) -> dict[str, Any]:
        pipe, log = mps_dirs(self.run_dir, device)
        return state.setdefault("mps", {}).setdefault(str(device), {
            "running": False, "pipe_dir": pipe, "log_dir": log, "default_pinned_mem_limit_mib": None,
            "default_active_thread_percentage": None})

    def status(self, device: int | str) -> dict[str, Any] | None:
        """The recorded daemon (sim-only), or None if never started."""
        return self.backend.store.read().get("mps", {}).get(str(device))

    def running(self, device: int | str) -> bool:
        entry = self.status(device)
        return bool(entry and entry["running"])

    def start(self, device: int | str) -> tuple[str, str]:
        with self.backend.store.transaction() as state:
            entry = self._entry(state, device)
            entry["running"] = True
            return entry["pipe_dir"], entry["log_dir"]

    def stop(self, device: int | str) -> None:
        with self.backend.store.transaction() as state:
            self._entry(state, device).update(running=False, default_pinned_mem_limit_mib=None,
                                              default_active_thread_percentage=None)

    def _set(self, device: int | str, key: str, value: int) -> None:
        with self.backend.store.transaction() as state:
            entry = self._entry(state, device)
            if not entry["running"]:
                raise GpuError(NvmlCode.UNINITIALIZED, f"MPS control daemon for {device} is not running")
            entry[key] = value

    def set_default_pinned_mem_limit(self, device: int | str, mib: int) -> None:
        self._set(device, "default_pinned_mem_limit_mib", int(mib))

    def set_default_active_thread_percentage(self, device: int | str, percentage: int) -> None:
        self._set(device, "default_active_thread_percentage", int(percentage))
