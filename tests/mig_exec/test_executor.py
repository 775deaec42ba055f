"""The executor's state machine on the simulated backend and a fake Slurm: order, idempotence, busy."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushare.gpus import GiB
from gpushare.mig_manager.device_ops import read_layout
from gpushare.mig_manager.executor import ExecSettings, Executor
from gpushare.mig_manager.journal import JournalError, JournalStore
from gpushare.policy.layout import Instance, format_layout
from gpushare.mig_manager.slurm_actions import gpu_counts
from mig_exec_fakes import NODE, FakeSlurm, sim_gpu, store

TARGET = {0: (Instance("2g.10gb", 0), Instance("1g.5gb", 2), Instance("1g.5gb", 3), Instance("3g.20gb", 4))}
TARGET_TEXT = "2g.10gb@0,1g.5gb@2,1g.5gb@3,3g.20gb@4"
WANT_COUNTS = {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def make(tmp_path: Path, backend=None, slurm=None, **settings):  # type: ignore[no-untyped-def]
    clock = Clock()
    backend = backend or sim_gpu()
    slurm = slurm or FakeSlurm()
    ex = Executor(NODE, backend, slurm, store(tmp_path), ExecSettings(**{"poll_s": 1.0, **settings}),
                  clock=clock, sleep=clock.sleep)
    return ex, backend, slurm, clock


def test_apply_runs_the_choreography_in_order(tmp_path: Path) -> None:
    ex, backend, slurm, _ = make(tmp_path)
    result = ex.apply(TARGET)
    assert result.outcome == "applied", result
    assert format_layout(read_layout(backend, 0)) == TARGET_TEXT
    assert slurm.events == ["drain", "write", "restart", "resume"]
    assert gpu_counts(slurm.ctld_gres) == WANT_COUNTS
    assert all(line.startswith(f"NodeName={NODE} Name=gpu Type=") and "MultipleFiles=" in line
               for line in slurm.lines) and len(slurm.lines) == 4
    # lines (Slurm's device numbering) in memory-slice order, not in creation (GI id) order
    assert [line.split("Type=")[1].split()[0] for line in slurm.lines] == \
        ["2g.10gb", "1g.5gb", "1g.5gb", "3g.20gb"]
    journal = ex.store.load(NODE)
    assert (journal.phase, journal.step, len(journal.history)) == ("done", "resumed", 1)
    assert [op.text() for op in journal.ops][0] == "destroy 7g.40gb@0 on GPU 0"


def test_a_release_whose_reconfigure_applies_the_layout_is_not_restarted(tmp_path: Path) -> None:
    ex, _, slurm, _ = make(tmp_path, slurm=FakeSlurm(reconfigure="applies"))
    assert ex.apply(TARGET).outcome == "applied"
    assert slurm.events == ["drain", "write", "reconfigure", "resume"]
    assert gpu_counts(slurm.ctld_gres) == WANT_COUNTS
    assert any("scontrol reconfigure" in line for line in ex.store.load(NODE).log)


def test_a_reconfigure_that_does_not_show_the_layout_falls_back_to_the_restart(tmp_path: Path) -> None:
    ex, _, slurm, clock = make(tmp_path, slurm=FakeSlurm(reconfigure="ignored"), verify_timeout_s=60.0)
    started = clock.t
    assert ex.apply(TARGET).outcome == "applied"
    assert slurm.events == ["drain", "write", "reconfigure", "restart", "resume"]
    assert gpu_counts(slurm.ctld_gres) == WANT_COUNTS
    log = ex.store.load(NODE).log
    assert any("reconfigure left n1 at IDLE+DRAIN Gres=gpu:7g.40gb:1" in line for line in log), log
    assert 20.0 <= clock.t - started < 25.0  # waited RECONFIGURE_WAIT_S for the layout, not verify_timeout_s


def test_second_apply_is_a_no_op(tmp_path: Path) -> None:
    ex, _, slurm, _ = make(tmp_path)
    ex.apply(TARGET)
    before = list(slurm.events)
    assert ex.apply(TARGET).outcome == "already"
    assert slurm.events == before


def test_slurm_disagreeing_with_the_gpu_is_repaired_without_device_ops(tmp_path: Path) -> None:
    backend = sim_gpu([("2g.10gb", 0), ("1g.5gb", 2), ("1g.5gb", 3), ("3g.20gb", 4)])
    ex, _, slurm, _ = make(tmp_path, backend=backend)  # Slurm still thinks 7g.40gb
    assert ex.apply(TARGET).outcome == "applied"
    assert gpu_counts(slurm.ctld_gres) == WANT_COUNTS
    assert ex.store.load(NODE).ops == []


def test_busy_instance_is_never_destroyed_and_the_node_is_resumed(tmp_path: Path) -> None:
    backend = sim_gpu()
    gi = backend.gpu_instances(0)[0].id
    backend.start_process(0, 4242, 1 * GiB, gi=gi)
    ex, _, slurm, clock = make(tmp_path, backend=backend, wait_timeout_s=30)
    result = ex.apply(TARGET)
    assert result.outcome == "busy" and "process runs" in result.detail
    assert format_layout(read_layout(backend, 0)) == "7g.40gb@0"
    assert slurm.events == ["drain", "resume"] and not slurm.drained
    assert clock.t >= 1030
    assert ex.store.load(NODE).phase == "rolled_back"


def test_a_slurm_job_holding_the_profile_blocks_until_it_ends(tmp_path: Path) -> None:
    slurm = FakeSlurm()
    slurm.jobs = {"17": {"7g.40gb": 1}}
    ex, backend, _, clock = make(tmp_path, slurm=slurm, wait_timeout_s=100)
    real_sleep = clock.sleep

    def sleep(s: float) -> None:  # the job ends after 10 s
        real_sleep(s)
        if clock.t >= 1010:
            slurm.jobs = {}
    ex.sleep = sleep
    assert ex.apply(TARGET).outcome == "applied"
    assert 1010 <= clock.t < 1020


def test_jobs_on_unaffected_profiles_do_not_block_unless_wait_is_node(tmp_path: Path) -> None:
    start = [("3g.20gb", 0), ("4g.20gb", 4)] if False else [("4g.20gb", 0), ("3g.20gb", 4)]
    target = {0: (Instance("4g.20gb", 0), Instance("2g.10gb", 4), Instance("1g.5gb", 6))}
    slurm = FakeSlurm("gpu:4g.20gb:1,gpu:3g.20gb:1")
    slurm.jobs = {"5": {"4g.20gb": 1}}
    ex, backend, _, _ = make(tmp_path, backend=sim_gpu(start), slurm=slurm)
    assert ex.apply(target).outcome == "applied"
    assert format_layout(read_layout(backend, 0)) == "4g.20gb@0,2g.10gb@4,1g.5gb@6"

    slurm2 = FakeSlurm("gpu:4g.20gb:1,gpu:3g.20gb:1")
    slurm2.jobs = {"5": {"4g.20gb": 1}}
    ex2, backend2, _, _ = make(tmp_path / "b", backend=sim_gpu(start), slurm=slurm2, wait="node",
                               wait_timeout_s=5)
    assert ex2.apply(target).outcome == "busy"
    assert format_layout(read_layout(backend2, 0)) == "4g.20gb@0,3g.20gb@4"


def test_rate_limit_counts_finished_reshapes(tmp_path: Path) -> None:
    ex, backend, slurm, clock = make(tmp_path, max_per_hour=1)
    assert ex.apply(TARGET).outcome == "applied"
    back = {0: (Instance("7g.40gb", 0),)}
    clock.t += 60
    assert ex.apply(back).outcome == "rate_limited"
    clock.t += 3600
    assert ex.apply(back).outcome == "applied"


def test_a_node_drained_by_an_admin_stays_drained(tmp_path: Path) -> None:
    slurm = FakeSlurm()
    slurm.drained, slurm.reason = True, "bad fan"
    ex, _, _, _ = make(tmp_path, slurm=slurm)
    assert ex.apply(TARGET).outcome == "applied"
    assert slurm.drained and slurm.reason == "bad fan" and "resume" not in slurm.events


def test_drain_none_never_drains(tmp_path: Path) -> None:
    ex, _, slurm, _ = make(tmp_path, drain="none")
    assert ex.apply(TARGET).outcome == "applied"
    assert "drain" not in slurm.events and "resume" not in slurm.events


def test_reconcile_resumes_a_leftover_drain_of_ours(tmp_path: Path) -> None:
    ex, _, slurm, _ = make(tmp_path)
    slurm.drained, slurm.reason = True, "gpushare-mig reshape 0123abcd"
    assert ex.reconcile().outcome == "rolled_back" and not slurm.drained
    assert ex.reconcile().outcome == "nothing"


def test_illegal_targets_are_refused_before_anything_happens(tmp_path: Path) -> None:
    ex, backend, slurm, _ = make(tmp_path)
    with pytest.raises(ValueError, match="cannot start at slice 7"):
        ex.apply({0: (Instance("1g.5gb", 7),)})
    with pytest.raises(ValueError, match="both use memory slice"):
        ex.apply({0: (Instance("3g.20gb", 4), Instance("2g.10gb", 4))})
    assert slurm.events == [] and format_layout(read_layout(backend, 0)) == "7g.40gb@0"


def test_journal_rejects_foreign_files(tmp_path: Path) -> None:
    js = JournalStore(tmp_path)
    (tmp_path / "n1.json").write_text('{"version": 99}')
    with pytest.raises(JournalError, match="version"):
        js.load("n1")
    (tmp_path / "n1.json").write_text('{"version": 1, "node": "n1", "surprise": 1}')
    with pytest.raises(JournalError, match="surprise"):
        js.load("n1")
    with pytest.raises(JournalError):
        js.path("../etc/passwd")


def test_one_run_per_node_at_a_time(tmp_path: Path) -> None:
    ex, _, _, _ = make(tmp_path)
    with ex.store.lock(NODE):
        with pytest.raises(JournalError, match="another gpushare mig run"):
            ex.apply(TARGET)
        with pytest.raises(JournalError, match="another gpushare mig run"):
            ex.reconcile()
    assert ex.apply(TARGET).outcome == "applied"


def test_a_gpu_emptied_by_a_reset_gets_its_last_layout_back_despite_the_rate_limit(tmp_path: Path) -> None:
    from gpushare.config import parse_config
    from gpushare.mig_manager.reshape import restore_after_reset

    ex, backend, slurm, _ = make(tmp_path, max_per_hour=1)
    cfg = parse_config({})
    assert restore_after_reset(cfg, ex) is None  # nothing applied yet
    assert ex.apply(TARGET).outcome == "applied"
    assert restore_after_reset(cfg, ex) is None  # in place
    backend.reset_gpu(0)  # instances do not survive a reset
    assert read_layout(backend, 0) == ()
    result = restore_after_reset(cfg, ex)
    assert result is not None and result.outcome == "applied", result
    assert format_layout(read_layout(backend, 0)) == TARGET_TEXT
    assert gpu_counts(slurm.ctld_gres) == WANT_COUNTS and not slurm.drained


def test_observe_proposes_the_reshape_and_off_plans_nothing(tmp_path: Path) -> None:
    import json

    ex, backend, slurm, _ = make(tmp_path, mode="observe")
    before = format_layout(read_layout(backend, 0))
    result = ex.apply(TARGET)
    assert result.outcome == "proposed" and "would reshape" in result.detail, result
    proposal = json.loads((ex.store.directory / f"{NODE}.proposal.json").read_text())
    assert (proposal["before"], proposal["target"], proposal["ops"][0]) == (
        {"0": before}, {"0": TARGET_TEXT}, "destroy 7g.40gb@0 on GPU 0")
    assert format_layout(read_layout(backend, 0)) == before and slurm.events == []  # no drain, write, restart
    assert not ex.store.load(NODE).history  # the rate limit's count is unchanged
    off, _, off_slurm, _ = make(tmp_path / "off", mode="off")
    assert off.apply(TARGET).outcome == "nothing" and off_slurm.events == []
    assert not (off.store.directory / f"{NODE}.proposal.json").exists()
