"""Abuse of OOM recovery by a hostile user, against the real hook with a faithful fake Slurm.

A log line is the user's text: printing PyTorch's OOM message must not buy a whole GPU (corroboration),
many cheap jobs must not repeat it (per-user budget), a recovered job gets its own place in the queue back
(no fixed boost), and a storm of failed jobs costs no Slurm query, lock or ledger file unless it may be
an OOM (cheap filter first, bounded concurrency).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pwd
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare.atomic import write_json_atomic
from gpushare.config import parse_config
from gpushare.epilog import slurmctld_epilog as hook
from gpushare.epilog.ledger import Ledger
from oom_fake_slurm import FakeSlurm

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")
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
    [kept] = tmp_path.glob("err-1.txt.oom-run0.*")
    assert "does not count against your OOM recoveries" in kept.read_text()  # kept


@pytest.mark.hostile
def test_an_old_collateral_note_buys_nothing(tmp_path: Path) -> None:
    """A note from long before the job failed (its own later OOM) is no evidence."""
    cfg = _cfg(tmp_path)
    fake = _oom_job(tmp_path, comment=_collateral(time.time() - 3600))
    fake.fields["TresPerNode"] = "gres:shard:11"
    assert hook.run(_env(), client=fake, cfg=cfg, finish_later=None).startswith("stay_failed")


# --- a neighbour against the victim's kept log, a link swapped in for a folder, two offenders --------------

VICTIM, NEIGHBOUR = 4242, 4343  # two ordinary users (no passwd entry needed: the hook drops to the numbers)
SHARED = 'gpushare:{"decision":"shared","run":{"peak_gib":3.9},"v":1}'  # a corroborated OOM of its own


@pytest.fixture
def sticky() -> Iterator[Path]:
    """A shared scratch folder as /tmp is: everyone may create, only owners may remove (mode 1777)."""
    path = Path(tempfile.mkdtemp(prefix="gpushare-sticky-", dir="/tmp"))
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _victim_job(log: Path, work_dir: Path, comment: str = SHARED) -> FakeSlurm:
    log.write_text(OOM_TEXT)
    os.chown(log, VICTIM, VICTIM)
    return FakeSlurm({"JobId": "1", "StdErr": str(log), "StdOut": str(log), "AdminComment": comment,
                      "UserId": f"victim({VICTIM})", "GroupId": f"victim({VICTIM})", "WorkDir": str(work_dir)})


def _victim_env() -> dict[str, str]:
    return {"SLURM_JOB_ID": "1", "SLURM_JOB_UID": str(VICTIM), "SLURM_JOB_GID": str(VICTIM)}


@root_only
@pytest.mark.hostile
def test_a_neighbour_cannot_deny_the_copy_of_a_victims_log(tmp_path: Path, sticky: Path) -> None:
    """The neighbour read StdErr= from ``scontrol show job`` and created every name the copy could have had
    before (``<log>.oom-run<N>`` for the next runs) in the shared sticky folder: the copy is made anyway, as
    the victim, under a name nobody could know, and the victim reads where in its note and its record."""
    log = sticky / "job-1.err"
    fake = _victim_job(log, sticky)
    for run in range(4):
        squat = sticky / f"job-1.err.oom-run{run}"
        squat.write_text("nothing to see here\n")
        os.chown(squat, NEIGHBOUR, NEIGHBOUR)
        os.chmod(squat, 0o644)
    outcome = hook.run(_victim_env(), client=fake, cfg=_cfg(tmp_path), finish_later=None)
    assert outcome.startswith("requeue"), outcome
    [kept] = [p for p in sticky.glob("job-1.err.oom-run0.*")]
    assert kept.stat().st_uid == VICTIM and kept.stat().st_mode & 0o777 == 0o600
    assert kept.read_text().startswith(OOM_TEXT)  # the failed run's output, whatever the rerun does to the log
    assert f"kept in {kept}" in kept.read_text() and f"kept in {kept}" in log.read_text()  # and where it is
    record = json.loads(fake.fields["AdminComment"].removeprefix("gpushare:"))
    assert record["oom"]["kept"] == kept.name.removeprefix("job-1.err.")  # `scontrol show job` tells it too
    assert (sticky / "job-1.err.oom-run0").read_text() == "nothing to see here\n"  # the squat untouched


@root_only
def test_a_log_whose_folder_takes_no_copy_is_kept_in_the_working_directory(tmp_path: Path, sticky: Path) -> None:
    """The admin created the log in a folder the user cannot write: the copy goes to the job's working
    directory; with no place at all the job is not requeued, so its log is never truncated uncopied."""
    logs = sticky / "admin-logs"
    logs.mkdir(mode=0o755)  # root's
    work = sticky / "work"
    work.mkdir()
    os.chown(work, VICTIM, VICTIM)
    log = logs / "job-1.err"
    fake = _victim_job(log, work)
    assert hook.run(_victim_env(), client=fake, cfg=_cfg(tmp_path), finish_later=None).startswith("requeue")
    [kept] = work.glob("job-1.err.oom-run0.*")
    assert kept.read_text().startswith(OOM_TEXT) and kept.stat().st_uid == VICTIM
    assert not list(logs.glob("*.oom-run*"))

    os.chmod(work, 0o555)  # now nowhere to copy to: no requeue, the log stays whole and says why
    log.write_text(OOM_TEXT)
    fake = _victim_job(log, work)
    fake.fields.update(JobId="2")
    outcome = hook.run({**_victim_env(), "SLURM_JOB_ID": "2"}, client=fake, cfg=_cfg(tmp_path / "2"),
                       finish_later=None)
    assert outcome.startswith("stay_failed") and "could not be kept" in outcome, outcome
    assert not [c for c in fake.calls if c[0] == "requeuehold"]
    assert log.read_text().startswith(OOM_TEXT) and "a copy of its log could not be made" in log.read_text()
    assert Ledger(str(tmp_path / "2" / "ledger")).user_recoveries(VICTIM) == 0  # nor charged


def _copy_under_a_size_limit(log: str, places: list[str], out: "multiprocessing.Queue[Any]") -> None:
    import resource
    import signal

    from gpushare.user_files import TailError, _copy_here

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    try:
        out.put(("kept", _copy_here(log, places)))
    except TailError as exc:
        out.put(("error", str(exc)))


def test_a_copy_that_fails_part_way_leaves_no_half_copy(tmp_path: Path) -> None:
    """The disk fills while the copy is written: that copy is removed and the next place tried; with none
    left the caller is told (and does not requeue)."""
    log = tmp_path / "job-1.err"
    log.write_bytes(b"step\n" * 20000 + OOM_TEXT.encode())
    places = [str(tmp_path / "job-1.err.oom-run0.0123456789ab"), str(tmp_path / "work.oom-run0.0123456789ab")]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_copy_under_a_size_limit, args=(str(log), places, queue))
    proc.start()
    outcome, text = queue.get(timeout=30)
    proc.join(30)
    assert outcome == "error" and "no copy could be made" in text and text.count("File too large") == 2, text
    assert not any(os.path.exists(p) for p in places)


def _detect_as(reader_uid: int, job: Any, cfg: Any, out: "multiprocessing.Queue[Any]") -> None:
    os.setgroups([])
    os.setgid(reader_uid)
    os.setuid(reader_uid)
    verdict = hook.detect(job, cfg)
    out.put((verdict.is_oom, verdict.problems))


@root_only
@pytest.mark.hostile
def test_a_folder_swapped_for_a_link_does_not_make_the_hook_read_slurmusers_files(tmp_path: Path,
                                                                                   sticky: Path) -> None:
    """SlurmUser is unprivileged, so the hook reads as SlurmUser: the user swapped the log's folder for a link
    to SlurmUser's own folder between the job's end and the hook, where a 0600 file of SlurmUser's has the log's
    name (and an OOM line). Its lines are not matched: the opened file is not the job's user's."""
    from gpushare.policy.oom_recovery import JobFacts
    from gpushare.slurm.gres_request import GresRequest

    slurm_user = pwd.getpwnam("nobody").pw_uid
    private = sticky / "slurmuser-private"
    private.mkdir(mode=0o700)
    secret = private / "job-1.err"
    secret.write_text(OOM_TEXT)
    os.chmod(secret, 0o600)
    for path in (private, secret):
        os.chown(path, slurm_user, slurm_user)
    home = sticky / "victim"
    home.mkdir()
    os.chown(home, VICTIM, VICTIM)
    (home / "logs").symlink_to(private)  # was a folder of the user's while the job ran
    os.lchown(home / "logs", VICTIM, VICTIM)
    job = JobFacts(job_id="1", state="COMPLETING", exit_code=1, exit_signal=0, restarts=0,
                   gres=GresRequest.parse("gres:shard:4"), node="n1", uid=VICTIM, gid=VICTIM,
                   log_paths=(str(home / "logs" / "job-1.err"),), record=None)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_detect_as, args=(slurm_user, job, _cfg(tmp_path), queue))
    proc.start()
    is_oom, problems = queue.get(timeout=30)
    proc.join(30)
    assert not is_oom and "not a file of the job's user" in " ".join(problems), problems


def _over_cap(by: str, at: float, **run: object) -> str:
    """A job marked the victim of ``by`` that was itself over its 4 GiB cap (peak 9 GiB) on the same GPU."""
    return "gpushare:" + json.dumps({"collateral": {"at": at, "by": by, "gpu": 0}, "decision": "shared",
                                     "run": {"peak_gib": 9.0, "cap_gib": 4.0, **run}, "v": 1})


@pytest.mark.hostile
def test_two_jobs_over_their_caps_do_not_excuse_each_other(tmp_path: Path) -> None:
    """One user's jobs 11 and 12 on one GPU, each over its cap, each marked the other's victim by the agent:
    neither is re-run as collateral; each recovery is an ordinary one, charged to retries and budget."""
    cfg = _cfg(tmp_path, max_recoveries_per_user_day=5)
    now = time.time()
    outcomes = []
    for job, other in (("11", "12"), ("12", "11")):
        fake = _oom_job(tmp_path, job, comment=_over_cap(other, now - 3))
        outcomes.append(hook.run(_env(job), client=fake, cfg=cfg, finish_later=None))
        assert "collateral" not in fake.fields["AdminComment"].partition('"oom"')[2]
    assert all(o.startswith("requeue") and "collateral" not in o for o in outcomes), outcomes
    ledger = Ledger(cfg.oom.ledger_dir)
    assert ledger.user_recoveries(os.geteuid()) == 2
    assert [ledger.get(j, 0)["new_gres"] for j in ("11", "12")] == ["gres:shard:40"] * 2  # the usual, larger run


@pytest.mark.hostile
def test_the_decision_never_calls_an_offender_collateral(tmp_path: Path) -> None:
    """The decision itself, with both jobs' evidence: each is the other's marked victim, and each record
    shows its own overrun (its peak over its cap, or the backstop acting on it, in the AdminComment or in the
    agent's run record). Each OOM counts as corroborated, so only the collateral rule is judged."""
    from gpushare.epilog.oom_evidence import run_records
    from gpushare.policy.oom_recovery import JobFacts, OomEvidence, OomVerdict, collateral_note, decide, own_overrun
    from gpushare.slurm.gres_request import GresRequest
    from gpushare.slurm.record import parse as parse_record

    cfg = _cfg(tmp_path, corroborate="no")
    records = tmp_path / "records"
    records.mkdir(mode=0o755)
    now = time.time()
    verdict = OomVerdict(True, "GPU out of memory (pytorch)", "pytorch", OOM_TEXT.strip(), "/e")
    write_json_atomic(records / "13.0.json", {"job": "13", "restarts": 0, "oom": {"source": "agent-backstop"}})
    cases = {"11": _over_cap("12", now - 3), "12": _over_cap("11", now - 3, stop="agent-backstop"),
             "13": _collateral(now - 3, "14")}  # 13: its own peak looks fine, its run record shows the backstop
    for job_id, comment in cases.items():
        record = parse_record(comment)
        facts = JobFacts(job_id=job_id, state="COMPLETING", exit_code=1, exit_signal=0, restarts=0,
                         gres=GresRequest.parse("gres:shard:4"), node="n1", uid=7, gid=7, log_paths=("/e",),
                         record=record)
        evidence = OomEvidence(facts, verdict, run_records(str(records), job_id, 0), ended_at=now)
        note = collateral_note(record, evidence.run_records, now, 70.0)
        overran = own_overrun(record, evidence.run_records, facts.gres, cfg)
        assert note is not None and overran is not None, job_id
        action = decide(evidence, cfg)
        assert action.kind == "requeue" and action.charged and "collateral" not in action.reason, (job_id, action)
        assert action.new_gres == "gres:shard:40" and action.oom and action.oom["n"] == 1
    victim = parse_record(_collateral(now - 3))  # a real victim (peak 1 GiB of 4) still gets its free re-run
    assert own_overrun(victim, run_records(str(records), "14", 0), GresRequest.parse("gres:shard:4"), cfg) is None


@pytest.mark.hostile
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=12), st.integers(0, 3))
def test_collateral_reruns_are_bounded_whatever_notes_a_job_carries(runs: list[tuple[bool, bool]],
                                                                    max_retries: int) -> None:
    """Any sequence of OOMs of one job, each with or without a neighbour's note and with or without its own
    corroboration: at most one re-run is free, and the job is requeued at most ``max_retries`` + 1 times."""
    from gpushare.policy.oom_recovery import JobFacts, OomEvidence, OomVerdict, decide, failed_size_bytes
    from gpushare.slurm.gres_request import GresRequest

    cfg = parse_config({"oom": {"max_retries": max_retries, "max_recoveries_per_user_day": 0},
                        "nodes": [{"names": "n1", "gpu": "a100-40gb", "count": 2}]})
    verdict = OomVerdict(True, "GPU out of memory (pytorch)", "pytorch", OOM_TEXT.strip(), "/e")
    record: dict[str, Any] = {"decision": "shared", "run": {"peak_gib": 1.0}, "v": 1}
    gres, charged, free = "gres:shard:4", 0, 0
    for restarts, (noted, backed) in enumerate(runs):
        request = GresRequest.parse(gres)
        note = {"collateral": {"by": "7", "gpu": 0, "at": 1.0}} if noted else {}
        facts = JobFacts(job_id="1", state="COMPLETING", exit_code=1, exit_signal=0, restarts=restarts,
                         gres=request, node="n1", uid=7, gid=7, log_paths=("/e",), record={**record, **note})
        measured = ({"gpus": {"0": {"peak_bytes": failed_size_bytes(request, cfg)}}},) if backed else ()  # share full
        action = decide(OomEvidence(facts, verdict, measured, retries_used=charged, ended_at=1.0), cfg)
        if action.kind != "requeue":
            break
        charged, free = charged + action.charged, free + (not action.charged)
        record = {**record, "oom": action.oom}
        gres = action.new_gres or gres
    assert free <= 1 and charged <= max_retries


@pytest.mark.hostile
def test_a_sparse_20_gib_log_ending_in_the_oom_line_is_read(tmp_path: Path) -> None:
    """20 GiB of holes, then the OOM line: the tail's only line starts before the window and is still seen."""
    from gpushare.user_files import read_tail

    log = tmp_path / "job-1.err"
    with open(log, "wb") as handle:
        handle.truncate(20 << 30)  # sparse: costs no disk
        handle.seek(20 << 30)
        handle.write(OOM_TEXT.encode())
    try:
        assert "OutOfMemoryError" in read_tail(str(log), 65536, os.geteuid(), os.getegid())
        fake = FakeSlurm({"JobId": "1", "StdErr": str(log), "StdOut": str(log), "AdminComment": SHARED, **ME})
        outcome = hook.run(_env(), client=fake, cfg=_cfg(tmp_path), finish_later=None)
        assert "no log could be read" not in outcome and outcome.startswith("requeue"), outcome
    finally:
        for path in tmp_path.glob("job-1.err*"):
            path.unlink()
