"""Abuse of OOM recovery by a hostile user, against the real hook with a faithful fake Slurm.

A log line is the user's text: printing PyTorch's OOM message must not buy a whole GPU (corroboration),
many cheap jobs must not repeat it (per-user budget), a recovered job gets its own place in the queue back
(no fixed boost), and a storm of failed jobs costs no Slurm query, lock or ledger file unless it may be
an OOM (cheap filter first, bounded concurrency).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gpushare.atomic import write_json_atomic
from gpushare.config import parse_config
from gpushare.epilog import slurmctld_epilog as hook
from gpushare.epilog.ledger import Ledger
from oom_fake_slurm import FakeSlurm

OOM_TEXT = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ...\n"
ME = {"UserId": f"me({os.geteuid()})", "GroupId": f"me({os.getegid()})"}


def _env(job: str = "1", **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": job, "SLURM_JOB_UID": str(os.geteuid()), "SLURM_JOB_GID": str(os.getegid()),
            **extra}


def _cfg(tmp_path: Path, **oom: object):  # type: ignore[no-untyped-def]
    return parse_config({"oom": {"ledger_dir": str(tmp_path / "ledger"), **oom},
                         "submit": {"cache_dir": str(tmp_path / "cache")},
                         "agent": {"records_dir": str(tmp_path / "records")},
                         "nodes": [{"names": "n1", "gpu": "a100-40gb", "count": 2}]})


def _oom_job(tmp_path: Path, job: str = "1", comment: str = "") -> FakeSlurm:
    err = tmp_path / f"err-{job}.txt"
    err.write_text(OOM_TEXT)
    return FakeSlurm({"JobId": job, "StdErr": str(err), "StdOut": str(err), "AdminComment": comment, **ME})


def test_a_printed_oom_on_a_self_chosen_shard_buys_nothing(tmp_path: Path) -> None:
    """``--gres=shard:1`` + a printed OOM line + exit 1: once requeued on all 40 shards at nice -10000."""
    cfg = _cfg(tmp_path)
    fake = _oom_job(tmp_path)
    outcome = hook.run(_env(), client=fake, cfg=cfg, finish_later=None)
    assert outcome.startswith("stay_failed") and "not corroborated" in outcome
    assert not [c for c in fake.calls if c[0] in ("requeuehold", "update", "release")]
    assert not (tmp_path / "cache" / "by-script").exists()  # nor does it teach the estimate cache
    assert "do not confirm it" in (tmp_path / "err-1.txt").read_text()


def test_a_shared_job_far_below_its_share_is_not_believed(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    fake = _oom_job(tmp_path, comment='gpushare:{"decision":"shared","run":{"peak_gib":0.5},"v":1}')
    outcome = hook.run(_env(), client=fake, cfg=cfg, finish_later=None)
    assert outcome.startswith("stay_failed") and "peaked at 0.5 GiB" in outcome


def test_the_agents_record_corroborates(tmp_path: Path) -> None:
    """The per-job record the node side writes (root's directory) is evidence too."""
    cfg = _cfg(tmp_path)
    (tmp_path / "records").mkdir(mode=0o755)
    write_json_atomic(tmp_path / "records" / "1.0.json", {"job": "1", "restarts": 0,
                                                          "gpus": {"0": {"peak_bytes": int(3.8 * 2**30)}}})
    fake = _oom_job(tmp_path, comment='gpushare:{"decision":"shared","v":1}')
    assert hook.run(_env(), client=fake, cfg=cfg, finish_later=None).startswith("requeue")


def test_recoveries_per_user_are_capped_per_day(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, max_recoveries_per_user_day=2)
    outcomes = []
    for job in ("11", "12", "13"):
        fake = _oom_job(tmp_path, job, comment='gpushare:{"decision":"shared","run":{"peak_gib":3.9},"v":1}')
        outcomes.append(hook.run(_env(job), client=fake, cfg=cfg, finish_later=None))
    assert [o.split(":")[0] for o in outcomes] == ["requeue", "requeue", "stay_failed"]
    assert "max_recoveries_per_user_day = 2" in outcomes[2]
    assert Ledger(cfg.oom.ledger_dir).user_recoveries(os.geteuid()) == 2


def test_the_requeued_job_gets_its_own_nice_back_not_a_boost(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    fake = _oom_job(tmp_path, comment='gpushare:{"decision":"shared","run":{"peak_gib":3.9},"v":1}')
    fake.fields["Nice"] = "50"
    hook.run(_env(), client=fake, cfg=cfg, finish_later=None)
    fake.complete()
    hook.run_finisher("1.0", cfg, client=fake, wait_s=1)
    assert ("update", "1", "nice=50", "starttime=now") in fake.calls


def test_failed_cpu_jobs_cost_no_slurm_call_lock_or_file(tmp_path: Path) -> None:
    """A CPU array task exiting 1: no query, no ledger entry, no .lock file."""
    cfg = _cfg(tmp_path)
    Ledger(cfg.oom.ledger_dir).ensure()
    fake = _oom_job(tmp_path)
    for task in range(20):
        env = _env(str(100 + task), SLURM_JOB_NODELIST="c1", SLURM_JOB_EXIT_CODE2="1:0",
                   SLURM_JOB_WORK_DIR=str(tmp_path))
        assert hook.run(env, client=fake, cfg=cfg, finish_later=None) == "none: ran on no GPU node"
    assert fake.calls == []
    per_job = [p.name for p in Path(cfg.oom.ledger_dir).iterdir() if p.name[0].isdigit()]
    assert per_job == []  # only the ledger's few fixed files (prune stamp) exist


def test_failed_gpu_jobs_without_an_oom_line_cost_no_slurm_call(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    (tmp_path / "slurm-7.out").write_text("Traceback...\nValueError: bad\n")
    fake = _oom_job(tmp_path)
    env = _env("7", SLURM_JOB_NODELIST="n1", SLURM_JOB_EXIT_CODE2="1:0", SLURM_JOB_WORK_DIR=str(tmp_path))
    outcome = hook.run(env, client=fake, cfg=cfg, finish_later=None)
    assert outcome.startswith("none:") and fake.calls == []
    assert not list(Path(cfg.oom.ledger_dir).glob("[0-9]*"))


def test_heavy_hook_runs_are_bounded(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, max_concurrent_hooks=1)
    ledger = Ledger(cfg.oom.ledger_dir)
    ledger.ensure()
    fake = _oom_job(tmp_path, comment='gpushare:{"decision":"shared","run":{"peak_gib":3.9},"v":1}')
    with ledger.slot(1, 0) as held:
        assert held
        outcome = hook.handle("1", _env(), fake, cfg, ledger, None, slot_wait_s=0.2)
    assert outcome.startswith("skipped") and fake.calls == []


def test_old_finished_entries_and_history_are_pruned(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger")
    ledger.ensure()
    old, recent = 1_000_000.0, 1_000_000.0 + 40 * 86400
    for job, state in (("1", "done"), ("2", "decided")):
        ledger.put({"job": job, "restarts": 0, "action": "requeue", "state": state, "steps": []})
        entry = ledger.get(job, 0)
        write_json_atomic(ledger.dir / f"{job}.0.json", {**entry, "updated": old})
    (ledger.dir / "1.0.lock").touch()
    with open(ledger.dir / "history.jsonl", "w") as handle:
        handle.write('{"t": 1000000.0, "event": "old"}\n{"t": %f, "event": "new"}\n' % recent)
    assert ledger.prune(30 * 86400, now=recent) == 1
    assert sorted(p.name for p in ledger.dir.glob("*.*.*")) == ["2.0.json", "2.0.open"]  # open entries stay
    assert [h["event"] for h in ledger.history()] == ["new"]
    assert ledger.prune(30 * 86400, now=recent + 10) == 0  # once an hour at most


def test_oom_patterns_are_linear_on_long_hostile_lines() -> None:
    """Repeated heads on one 256 KiB line once took ~3 s (the rest of the line rescanned per head)."""
    import time

    from gpushare.epilog.oom_detect import compile_patterns, find_oom

    patterns = compile_patterns()
    for line, expect in (("OOM when allocating tensor " * 10000 + " device:CPU", False),
                         ("RESOURCE_EXHAUSTED " * 14000, False),
                         ("RESOURCE_EXHAUSTED: Failed to allocate request for " * 5200, False),
                         ("x" * 262144 + " OOM when allocating tensor with shape[1] on device:GPU:0", True)):
        started = time.perf_counter()
        found = find_oom(line, patterns)
        assert time.perf_counter() - started < 0.2
        assert (found is not None) == expect


def test_logs_are_read_with_the_users_supplementary_groups(tmp_path: Path) -> None:
    """A log readable only through a project group must be readable by the hook acting as that user."""
    import grp
    import pwd

    import pytest

    from gpushare.user_files import read_tail

    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    member = next(((g, u) for g in grp.getgrall() for u in g.gr_mem
                   if u in {p.pw_name for p in pwd.getpwall()} and pwd.getpwnam(u).pw_gid != g.gr_gid), None)
    if member is None:
        pytest.skip("no user with a supplementary group on this machine")
    group, user = member
    account = pwd.getpwnam(user)
    import shutil
    import tempfile

    outer = Path(tempfile.mkdtemp(prefix="gpushare-groups-", dir="/tmp"))  # pytest's tmp is root-only
    os.chmod(outer, 0o755)
    directory = outer / "project"
    directory.mkdir()
    os.chown(directory, 0, group.gr_gid)
    os.chmod(directory, 0o750)  # only the project group may enter
    log = directory / "job.err"
    log.write_text(OOM_TEXT)
    os.chown(log, 0, group.gr_gid)
    os.chmod(log, 0o640)
    try:
        assert "OutOfMemoryError" in read_tail(str(log), 4096, account.pw_uid, account.pw_gid, 5.0)
    finally:
        shutil.rmtree(outer)


def test_an_interrupted_recovery_is_finished_on_an_idle_cluster(tmp_path: Path) -> None:
    """The hook died right after requeuehold and no other job ends: ``--resume`` (the detached resumer
    every requeue starts, and the systemd timer) releases the job anyway."""
    cfg = _cfg(tmp_path)
    ledger = Ledger(cfg.oom.ledger_dir)
    ledger.ensure()
    fake = _oom_job(tmp_path)
    fake.fields.update(JobState="PENDING", Priority="0", Restarts="1")  # requeued and held, then the crash
    ledger.put({"job": "1", "restarts": 0, "action": "requeue", "state": "decided", "reason": "test",
                "new_gres": "gres:shard:40", "nice": 0, "oom": None, "steps": ["requeuehold"]})
    entry = ledger.get("1", 0)
    write_json_atomic(ledger.dir / "1.0.json", {**entry, "updated": entry["updated"] - 60})
    spawned: list[float] = []
    assert hook.run_resume(cfg, client=fake).startswith("resume: 1 ")
    assert ("release", "1") in fake.calls and ledger.get("1", 0)["state"] in ("requeued", "done")
    # and every requeue decision starts such a resumer before touching Slurm
    other = _oom_job(tmp_path, "2", comment='gpushare:{"decision":"shared","run":{"peak_gib":3.9},"v":1}')
    hook.handle("2", _env("2"), other, cfg, ledger, None, resume_later=spawned.append)
    assert spawned == [hook.RESUME_DELAY_S]


def _collateral(at: float, by: str = "7") -> str:
    return 'gpushare:{"collateral":{"at":%s,"by":"%s","gpu":0},"decision":"shared","run":{"peak_gib":1.0},"v":1}' % (
        at, by)


@pytest.mark.hostile
def test_a_victim_of_a_neighbours_overrun_is_requeued_on_its_share_at_no_cost(tmp_path: Path) -> None:
    """Far below its share (no corroboration of its own), but the agent saw job 7 over its cap on its GPU
    just before: requeued on the same share, retries and the user's budget untouched, 7 named."""
    cfg = _cfg(tmp_path, max_recoveries_per_user_day=1)
    fake = _oom_job(tmp_path, comment=_collateral(time.time() - 3))
    fake.fields["TresPerNode"] = "gres:shard:11"
    outcome = hook.run(_env(), client=fake, cfg=cfg, finish_later=None)
    assert outcome.startswith("requeue"), outcome
    ledger = Ledger(cfg.oom.ledger_dir)
    entry = ledger.get("1", 0)
    assert entry["new_gres"] == entry["old_gres"] and "collateral" in entry["reason"] and "job 7" in entry["reason"]
    assert entry["oom"]["by"] == "7" and entry["oom"]["n"] == 0 and ledger.user_recoveries(os.geteuid()) == 0
    assert not (tmp_path / "cache" / "by-script").exists()  # its estimate was right: nothing learned
    assert "does not count against your OOM recoveries" in (tmp_path / "err-1.txt.oom-run0").read_text()  # kept


@pytest.mark.hostile
def test_an_old_collateral_note_buys_nothing(tmp_path: Path) -> None:
    """A note from long before the job failed (its own later OOM) is no evidence."""
    cfg = _cfg(tmp_path)
    fake = _oom_job(tmp_path, comment=_collateral(time.time() - 3600))
    fake.fields["TresPerNode"] = "gres:shard:11"
    assert hook.run(_env(), client=fake, cfg=cfg, finish_later=None).startswith("stay_failed")
