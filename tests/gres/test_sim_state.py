"""The shared state file: separate processes see one set of simulated GPUs and lose no update."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from gpushare.gres import GpuError, NvmlCode
from gpushare.gres.sim_backend import SimBackend

SCENARIO = {"version": 1, "gpus": [{"model": "a100-40gb", "mig_mode": True}, {"model": "h100-80gb"}]}
WORKERS, PER_WORKER = 4, 15


def _worker(path: str, worker: int, barrier) -> None:
    backend = SimBackend.open(path)
    barrier.wait()
    for k in range(PER_WORKER):
        backend.start_process(1, pid=10_000 + worker * 1000 + k, memory_bytes=1 << 20)
        backend.mps("/run/x").start(f"w{worker}-{k}")


def test_concurrent_processes_lose_no_update(tmp_path):
    path = tmp_path / "state.json"
    SimBackend.from_scenario(SCENARIO, path)
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(WORKERS)
    procs = [ctx.Process(target=_worker, args=(str(path), w, barrier)) for w in range(WORKERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    backend = SimBackend.open(path)
    assert len(backend.processes(1)) == WORKERS * PER_WORKER
    assert len(json.loads(path.read_text())["mps"]) == WORKERS * PER_WORKER
    assert not list(tmp_path.glob(".state.json.*.tmp"))  # no temp files left behind


def test_second_process_sees_mig_changes(tmp_path, clock):
    path = tmp_path / "state.json"
    executor = SimBackend.from_scenario(SCENARIO, path, clock=clock)
    agent = SimBackend.open(path, clock=clock)
    gi = executor.create_gpu_instance(0, 9, 4)
    executor.create_compute_instance(0, gi.id)
    assert [d.profile_name for d in agent.mig_devices(0)] == ["3g.20gb"]
    with pytest.raises(GpuError) as err:
        agent.create_gpu_instance(0, 9, 4)
    assert err.value.code is NvmlCode.INSUFFICIENT_RESOURCES


def test_clock_shared_through_epoch(tmp_path, clock):
    path = tmp_path / "state.json"
    SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a30-24gb"}]}, path, clock=clock)
    clock.advance(12.5)
    assert SimBackend.open(path, clock=clock).now() == 12.5


def test_failed_operation_writes_nothing(tmp_path):
    path = tmp_path / "state.json"
    b = SimBackend.from_scenario(SCENARIO, path)
    before = path.read_bytes()
    with pytest.raises(GpuError):
        b.create_gpu_instance(0, 9, 3)
    assert path.read_bytes() == before


def test_missing_or_corrupt_state_is_a_clear_error(tmp_path):
    with pytest.raises(GpuError, match="does not exist .*gpushare.gres.sim_backend init"):
        SimBackend.open(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(GpuError, match="is not JSON"):
        SimBackend.open(bad)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"state_version": 0}))
    with pytest.raises(GpuError, match="state_version 0"):
        SimBackend.open(old)


def test_create_refuses_to_clobber(tmp_path):
    path = tmp_path / "state.json"
    SimBackend.from_scenario(SCENARIO, path)
    with pytest.raises(FileExistsError):
        SimBackend.from_scenario(SCENARIO, path)
    SimBackend.from_scenario(SCENARIO, path, overwrite=True)
