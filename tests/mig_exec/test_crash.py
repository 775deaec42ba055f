"""Kill the executor at every step boundary and check that ``reconcile`` converges.

Converged means: no run in progress; the node is not drained; slurmctld's GPU counts equal the GPU's
actual instances; the layout is the target (finished) or the one before (rolled back); and an instance
with a process in it was never destroyed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpushare.gpus import GiB
from gpushare.gres.gres_conf import node_gpus, node_gres
from gpushare.gres.sim_backend import SimBackend
from gpushare.mig_manager.device_ops import busy_instance_ids, read_layout
from gpushare.mig_manager.executor import ExecSettings, Executor
from gpushare.policy.layout import Instance, format_layout
from gpushare.mig_manager.slurm_actions import gpu_counts
from mig_exec_fakes import NODE, FakeSlurm, FileSlurm, sim_gpu, store

BEFORE = [("4g.20gb", 0), ("3g.20gb", 4)]
BEFORE_TEXT = "4g.20gb@0,3g.20gb@4"
TARGET = {0: (Instance("4g.20gb", 0), Instance("2g.10gb", 4), Instance("1g.5gb", 6))}
TARGET_TEXT = "4g.20gb@0,2g.10gb@4,1g.5gb@6"
SLURM_BEFORE = "gpu:4g.20gb:1,gpu:3g.20gb:1"


class Crash(Exception):
    pass


def busy_backend() -> tuple[SimBackend, int]:
    """The 4g.20gb runs a process for the whole test: it must survive every crash."""
    backend = sim_gpu(BEFORE)
    gi = next(g.id for g in backend.gpu_instances(0) if g.profile_name == "4g.20gb")
    backend.start_process(0, 777, 2 * GiB, gi=gi)
    return backend, gi


def executor(tmp_path: Path, backend, slurm, hook=None) -> Executor:  # type: ignore[no-untyped-def]
    now = [1000.0]  # waits pass in simulated time: a reconfigure that never shows costs its full wait

    def sleep(s: float) -> None:
        now[0] += s
    return Executor(NODE, backend, slurm, store(tmp_path), ExecSettings(poll_s=0.01, wait_timeout_s=0.05),
                    clock=lambda: now[0], sleep=sleep, hook=hook)


def crash_at(index: int):  # type: ignore[no-untyped-def]
    seen: list[str] = []

    def hook(label: str) -> None:
        seen.append(label)
        if len(seen) - 1 == index:
            raise Crash(label)
    return hook


def assert_converged(tmp_path: Path, backend, slurm, busy_gi: int) -> str:  # type: ignore[no-untyped-def]
    journal = store(tmp_path).load(NODE)
    layout = format_layout(read_layout(backend, 0))
    assert journal.phase in ("done", "rolled_back"), journal.log
    assert not slurm.drained, journal.log
    assert gpu_counts(slurm.ctld_gres) == gpu_counts(node_gres(node_gpus(backend), shards=False)), journal.log
    assert layout in (TARGET_TEXT, BEFORE_TEXT), journal.log
    assert busy_gi in busy_instance_ids(backend, 0)
    return journal.phase


def labels_of_a_clean_run(tmp_path: Path) -> list[str]:
    seen: list[str] = []
    backend, _ = busy_backend()
    executor(tmp_path, backend, FakeSlurm(SLURM_BEFORE), hook=seen.append).apply(TARGET)
    return seen


@pytest.mark.parametrize("reconfigure", ["unsupported", "applies", "ignored"])  # 22.05, 24.11+, fallback
def test_crash_at_every_boundary_then_reconcile(tmp_path: Path, reconfigure: str) -> None:
    labels = labels_of_a_clean_run(tmp_path / "clean")
    assert labels[0] == "planned" and labels[-1] == "done" and len(labels) >= 10
    phases = []
    for index, label in enumerate(labels):
        case = tmp_path / f"c{index}"
        backend, gi = busy_backend()
        slurm = FakeSlurm(SLURM_BEFORE, reconfigure=reconfigure)
        with pytest.raises(Crash):
            executor(case, backend, slurm, hook=crash_at(index)).apply(TARGET)
        executor(case, backend, slurm).reconcile()
        phases.append(assert_converged(case, backend, slurm, gi))
        assert executor(case, backend, slurm).reconcile().outcome == "nothing"
    assert "rolled_back" in phases and "done" in phases  # early crashes roll back, later ones finish


def test_crash_during_reconcile_too(tmp_path: Path) -> None:
    labels = labels_of_a_clean_run(tmp_path / "clean")
    for first in range(0, len(labels) - 1, 2):
        for second in range(0, 12, 3):
            case = tmp_path / f"c{first}-{second}"
            backend, gi = busy_backend()
            slurm = FakeSlurm(SLURM_BEFORE)
            with pytest.raises(Crash):
                executor(case, backend, slurm, hook=crash_at(first)).apply(TARGET)
            try:
                executor(case, backend, slurm, hook=crash_at(second)).reconcile()
            except Crash:
                pass
            executor(case, backend, slurm).reconcile()
            assert_converged(case, backend, slurm, gi)


def test_crash_inside_a_destroy_between_compute_and_gpu_instance(tmp_path: Path) -> None:
    backend, gi = busy_backend()
    slurm = FakeSlurm(SLURM_BEFORE)
    real = backend.destroy_gpu_instance

    def boom(index: int, gi_id: int) -> None:
        raise Crash("killed after the compute instance went")
    backend.destroy_gpu_instance = boom  # type: ignore[method-assign]
    with pytest.raises(Crash):
        executor(tmp_path, backend, slurm).apply(TARGET)
    backend.destroy_gpu_instance = real  # type: ignore[method-assign]
    assert executor(tmp_path, backend, slurm).reconcile().outcome == "applied"
    assert assert_converged(tmp_path, backend, slurm, gi) == "done"


def test_a_job_that_takes_an_instance_after_the_crash_forces_a_rollback(tmp_path: Path) -> None:
    """drain = "none": after the crash a job lands on the 3g.20gb; reconcile must not destroy it."""
    labels = labels_of_a_clean_run(tmp_path / "clean")
    backend, gi = busy_backend()
    slurm = FakeSlurm(SLURM_BEFORE)
    with pytest.raises(Crash):
        executor(tmp_path, backend, slurm, hook=crash_at(labels.index("idle"))).apply(TARGET)
    three = next(g.id for g in backend.gpu_instances(0) if g.profile_name == "3g.20gb")
    backend.start_process(0, 888, GiB, gi=three)
    result = executor(tmp_path, backend, slurm).reconcile()
    assert result.outcome == "busy", result
    assert format_layout(read_layout(backend, 0)) == BEFORE_TEXT and not slurm.drained


@pytest.mark.slow
def test_sigkill_between_every_pair_of_steps(tmp_path: Path) -> None:
    runner = Path(__file__).with_name("kill_runner.py")
    probe = tmp_path / "probe"
    probe.mkdir()
    from gpushare.mig_manager.device_ops import create_instance
    from gpushare.mig_manager.journal import Op

    def fresh(case: Path) -> None:
        SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb", "mig_mode": True}]},
                                 case / "state.json")
        sim = SimBackend.open(case / "state.json")
        for profile, start in BEFORE:
            create_instance(sim, Op("create", 0, profile, start))
        gi = next(g.id for g in sim.gpu_instances(0) if g.profile_name == "4g.20gb")
        sim.start_process(0, 777, GiB, gi=gi)
        FileSlurm(case / "slurm.json", SLURM_BEFORE)

    def run(case: Path, kill_at: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(runner), str(case / "state.json"), str(case / "slurm.json"),
                               str(case / "journal"), str(kill_at), TARGET_TEXT],
                              capture_output=True, text=True, timeout=60)

    fresh(probe)
    clean = run(probe, -1)
    assert clean.returncode == 0, clean.stderr
    labels = clean.stdout.split("\n")[0].split()
    assert clean.stdout.split("\n")[1] == "applied"
    for index in range(len(labels)):
        case = tmp_path / f"k{index}"
        case.mkdir()
        fresh(case)
        killed = run(case, index)
        assert killed.returncode == -9, (labels[index], killed.stderr)
        sim = SimBackend.open(case / "state.json")
        slurm = FileSlurm(case / "slurm.json")
        gi = next(g.id for g in sim.gpu_instances(0) if g.profile_name == "4g.20gb")
        Executor(NODE, sim, slurm, store(case), ExecSettings(poll_s=0.01, wait_timeout_s=0.05),
                 sleep=lambda s: None).reconcile()
        assert_converged(case, sim, slurm, gi)
