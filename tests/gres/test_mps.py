"""MPS control: job environment, the real daemon's commands (fake runner), the simulated record."""

from __future__ import annotations

import subprocess

import pytest

from gpushare.gres import GpuError, NvmlCode
from gpushare.gres.mps import DaemonMps, job_env, mps_dirs


def test_job_env():
    env = job_env("/run/gpushare/mps-0/pipe", 0, mem_limit_mib=6144, thread_percentage=50)
    assert env == {"CUDA_MPS_PIPE_DIRECTORY": "/run/gpushare/mps-0/pipe",
                   "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=6144M", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
    assert job_env("/p", "GPU-abc")  == {"CUDA_MPS_PIPE_DIRECTORY": "/p"}
    assert job_env("/p", "GPU-abc", 100)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "GPU-abc=100M"
    with pytest.raises(ValueError):
        job_env("/p", 0, thread_percentage=0)
    with pytest.raises(ValueError):
        job_env("/p", 0, mem_limit_mib=-1)


def test_dirs_are_per_device():
    assert mps_dirs("/run/g", 1) == ("/run/g/mps-1/pipe", "/run/g/mps-1/log")
    assert mps_dirs("/run/g", "MIG-a/b")[0] == "/run/g/mps-MIG-a_b/pipe"


class FakeRunner:
    def __init__(self, rc: int = 0) -> None:
        self.calls: list[tuple[list[str], dict, str | None]] = []
        self.rc = rc

    def __call__(self, cmd, env, stdin):
        self.calls.append((cmd, env, stdin))
        return subprocess.CompletedProcess(cmd, self.rc, "", "boom" if self.rc else "")


def test_daemon_start_and_commands(tmp_path):
    runner = FakeRunner()
    mps = DaemonMps(str(tmp_path), runner=runner)
    pipe, log = mps.start(0)
    cmd, env, stdin = runner.calls[-1]
    assert cmd == ["nvidia-cuda-mps-control", "-d"] and stdin is None
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"]) == ("0", pipe, log)
    (tmp_path / "mps-0" / "pipe" / "control").touch()  # what the daemon creates
    mps.set_default_pinned_mem_limit(0, 8192)
    mps.set_default_active_thread_percentage(0, 25)
    lines = [c[2] for c in runner.calls[1:]]
    assert lines == ["set_default_device_pinned_mem_limit 0 8192M\n", "set_default_active_thread_percentage 25\n"]
    before = len(runner.calls)
    mps.start(0)  # already running: only a get_server_list probe
    assert [c[2] for c in runner.calls[before:]] == ["get_server_list\n"]
    mps.stop(0)
    assert runner.calls[-1][2] == "quit\n"


def test_daemon_failures_are_gpu_errors(tmp_path):
    with pytest.raises(GpuError, match="boom"):
        DaemonMps(str(tmp_path), runner=FakeRunner(rc=1)).start(0)

    def missing(*_):
        raise FileNotFoundError("nvidia-cuda-mps-control")

    with pytest.raises(GpuError) as err:
        DaemonMps(str(tmp_path), runner=missing).start(0)
    assert err.value.code is NvmlCode.NOT_SUPPORTED and "install" in str(err.value)


def test_simulated_mps_is_recorded(sim, tmp_path):
    mps = sim.mps(str(tmp_path))
    assert not mps.running(0)
    with pytest.raises(GpuError):
        mps.set_default_active_thread_percentage(0, 50)
    pipe, _ = mps.start(0)
    assert mps.start(0)[0] == pipe  # idempotent
    mps.set_default_pinned_mem_limit(0, 4096)
    mps.set_default_active_thread_percentage(0, 50)
    status = mps.status(0)
    assert status["running"] and status["default_pinned_mem_limit_mib"] == 4096
    assert status["default_active_thread_percentage"] == 50 and status["pipe_dir"] == pipe
    mps.stop(0)
    assert not mps.running(0) and mps.status(0)["default_pinned_mem_limit_mib"] is None
