"""The EpilogSlurmctld executor against a faithful fake Slurm: once-only requeue, crash recovery, fail-safe."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from gpushare.epilog import slurmctld_epilog as hook
from gpushare.epilog.executor import resume_unfinished, wait_past_revocation
from gpushare.epilog.ledger import Ledger
from gpushare.config import parse_config
from oom_fake_slurm import FakeSlurm
from gpushare.slurm.client import SlurmError

ENV = {"SLURM_JOB_ID": "1", "SLURM_JOB_UID": str(os.geteuid()), "SLURM_JOB_GID": str(os.getegid())}
# gpushare sized the job and the node agent measured it near its 4 GiB share: a corroborated OOM
CORROBORATED = 'gpushare:{"decision":"shared","run":{"peak_gib":3.9},"v":1}'
OOM_TEXT = "Traceback...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ...\n"


@pytest.fixture
def setup(tmp_path: Path):  # type: ignore[no-untyped-def]
    err = tmp_path / "err-1.txt"
    err.write_text(OOM_TEXT)
    cfg = parse_config({"oom": {"ledger_dir": str(tmp_path / "ledger")},
                        "submit": {"cache_dir": str(tmp_path / "cache")},
                        "nodes": [{"names": "n1", "gpu": "a100-40gb", "count": 2}]})
    fake = FakeSlurm({"StdErr": str(err), "StdOut": str(tmp_path / "out-1.txt"),
                      "UserId": f"me({os.geteuid()})", "GroupId": f"me({os.getegid()})",
                      "AdminComment": CORROBORATED})
    return cfg, fake, err


def run(cfg, fake, later=None):  # type: ignore[no-untyped-def]
    return hook.run(ENV, client=fake, cfg=cfg, finish_later=later)


def test_oom_job_is_requeued_on_all_shards_then_boosted(setup) -> None:  # type: ignore[no-untyped-def]
    cfg, fake, err = setup
    later: list[tuple[str, int]] = []
    outcome = run(cfg, fake, lambda job, restarts: later.append((job, restarts)))
    assert outcome.startswith("requeue:") and later == [("1", 0)]
    assert [c[0] for c in fake.calls] == ["scontrol", "requeuehold", "update", "update", "release"]
    learned = sorted((Path(cfg.submit.cache_dir) / "by-script").glob("*.json"))
    assert len(learned) == 2  # the batch script's cached estimate and its training command's lesson were raised
    assert any(".cmd." in p.name for p in learned) and all(json.loads(p.read_text())["peak_total_bytes"] == 6 << 30
                                              for p in learned)  # 4 GiB failed -> 6 GiB
    assert fake.fields["TresPerNode"] == "gres:shard:40"
    assert '"to":"gres:shard:40"' in fake.fields["AdminComment"]
    # the user is told in their own log, and in the copy of its end kept before the rerun can truncate it
    [kept] = err.parent.glob(err.name + ".oom-run0.*")  # a name nobody could know before: not squattable
    assert "requeued with shard:4 -> shard:40" in err.read_text() and f"kept in {kept}" in err.read_text()
    assert kept.read_text().startswith(OOM_TEXT) and "requeued with shard:4 -> shard:40" in kept.read_text()
    assert json.loads(fake.fields["AdminComment"].removeprefix("gpushare:"))["oom"]["kept"] == kept.name.split(".", 2)[2]
    # the node Epilog rewrites the comment from a copy it read before our update (a real race, measured)
    fake.fields["AdminComment"] = 'gpushare:{"run":{"ttfk_s":1.5},"v":1}'
    fake.complete()  # slurmctld finishes completion; the detached finisher then runs
    assert hook.run_finisher("1.0", cfg, client=fake, wait_s=1).startswith("requeue:")
    assert ("update", "1", "nice=0", "starttime=now") in fake.calls
    record = json.loads(fake.fields["AdminComment"].removeprefix("gpushare:"))
    assert record["run"] == {"ttfk_s": 1.5} and record["oom"]["to"] == "gres:shard:40"  # both kept
    ledger = Ledger(cfg.oom.ledger_dir)
    assert ledger.get("1", 0)["state"] == "done"
    assert [h["event"] for h in ledger.history()] == ["requeue", "requeued"]


def test_second_epilog_run_never_requeues_again(setup) -> None:  # type: ignore[no-untyped-def]
    cfg, fake, _ = setup
    run(cfg, fake)
    requeues = [c for c in fake.calls if c[0] == "requeuehold"]
    fake.fields["Restarts"] = "0"  # even if Slurm showed the same run again, mid-recovery...
    assert "still completing" in run(cfg, fake)  # ...it only carries on with the same recovery
    fake.complete()
    assert hook.run_finisher("1.0", cfg, client=fake, wait_s=0).startswith("requeue:")
    fake.fields.update(Restarts="0", JobState="COMPLETING")
    assert run(cfg, fake) == "already handled: done"
    assert [c for c in fake.calls if c[0] == "requeuehold"] == requeues


def test_oom_again_after_recovery_stays_failed(setup) -> None:  # type: ignore[no-untyped-def]
    cfg, fake, err = setup
    run(cfg, fake)
    err.write_text(OOM_TEXT)  # the re-run truncates the log (the first run's end was kept) and OOMs too
    fake.fields.update(JobState="COMPLETING", Restarts="1", ExitCode="1:0")
    outcome = run(cfg, fake)
    assert outcome.startswith("stay_failed: GPU out of memory again after 1 recovery retry")
    assert len([c for c in fake.calls if c[0] == "requeuehold"]) == 1
    assert "the job stays failed" in err.read_text()
    assert Ledger(cfg.oom.ledger_dir).get("1", 1)["state"] == "stay_failed"


def test_non_oom_failure_and_success_are_left_alone(setup) -> None:  # type: ignore[no-untyped-def]
    cfg, fake, err = setup
    err.write_text("ValueError: bad input\n")
    assert run(cfg, fake).startswith("none: failed (exit 1) without")
    fake.fields["ExitCode"] = "0:0"
    assert run(cfg, fake) == "none: exited 0"
    assert fake.calls == [] and not list(Path(cfg.oom.ledger_dir).glob("*.json"))


def test_crash_midway_is_finished_by_the_next_run(setup) -> None:  # type: ignore[no-untyped-def]
    """slurmctld (or we) died after requeuehold: the job would stay held; the next hook run finishes it."""
    cfg, fake, _ = setup
    fake.fail = {"release": 1}
    with pytest.raises(Exception, match="simulated"):
        run(cfg, fake)
    entry = Ledger(cfg.oom.ledger_dir).get("1", 0)
    assert entry["steps"] == ["requeuehold", "gres", "comment"]
    fake.complete()
    ledger = Ledger(cfg.oom.ledger_dir)
    resume_unfinished(fake, ledger, min_age_s=0)  # the next job's epilog, any job
    assert ledger.get("1", 0)["state"] == "done"
    assert [c[0] for c in fake.calls].count("requeuehold") == 1
    assert fake.calls[-1][0] == "update" and "starttime=now" in fake.calls[-1]


def test_entries_of_purged_jobs_are_closed(setup) -> None:  # type: ignore[no-untyped-def]
    cfg, fake, _ = setup
    ledger = Ledger(cfg.oom.ledger_dir)
    ledger.put({"job": "1", "restarts": 0, "action": "requeue", "state": "requeued", "reason": "r",
                "new_gres": "gres:shard:40", "steps": ["requeuehold"]})
    def purged(job_id: str) -> None:
        raise SlurmError("slurm_load_jobs error: Invalid job id specified")

    fake.job = purged
    resume_unfinished(fake, ledger, min_age_s=0)
    assert ledger.get("1", 0)["state"] == "gone"


def test_refused_requeue_leaves_the_job_failed_and_the_entry_closed(setup) -> None:  # type: ignore[no-untyped-def]
    cfg, fake, err = setup
    fake.fail = {"requeuehold": 1}
    assert run(cfg, fake).startswith("stay_failed: Slurm refused the requeue")
    entry = Ledger(cfg.oom.ledger_dir).get("1", 0)
    assert entry["state"] == "stay_failed" and Ledger(cfg.oom.ledger_dir).unfinished(min_age_s=0) == []
    assert "requeued" not in err.read_text()  # the user is not told of a requeue that did not happen
    assert not list(err.parent.glob(err.name + ".oom-run0*"))  # nor left a copy of a log that stays whole
    assert Ledger(cfg.oom.ledger_dir).retries_used("1") == 0


def test_refused_gres_change_still_releases_the_job(setup) -> None:  # type: ignore[no-untyped-def]
    cfg, fake, _ = setup
    fake.fail = {"update": 1}
    run(cfg, fake)
    entry = Ledger(cfg.oom.ledger_dir).get("1", 0)
    assert "gres-refused" in entry["steps"] and "release" in entry["steps"]
    assert ("release", "1") in fake.calls


def _concurrent(cfg_dir: str, err: str, calls: str) -> None:
    cfg = parse_config({"oom": {"ledger_dir": cfg_dir}, "submit": {"cache_dir": cfg_dir + "-cache"},
                        "nodes": [{"names": "n1", "gpu": "a100-40gb"}]})
    fake = FakeSlurm({"StdErr": err, "UserId": f"me({os.geteuid()})", "AdminComment": CORROBORATED},
                     calls_file=calls)
    try:
        hook.run(ENV, client=fake, cfg=cfg, finish_later=None)
    except Exception:  # noqa: BLE001 - only the shared call log matters here
        pass


def test_twenty_simultaneous_epilog_runs_requeue_once(setup, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg, _, err = setup
    calls = tmp_path / "calls"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_concurrent, args=(cfg.oom.ledger_dir, str(err), str(calls))) for _ in range(20)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
    assert calls.read_text().count("requeuehold") == 1


def test_a_good_job_creates_nothing(tmp_path: Path) -> None:
    cfg = parse_config({"oom": {"ledger_dir": str(tmp_path / "ledger")}})
    env = {"SLURM_JOB_ID": "3", "SLURM_JOB_EXIT_CODE2": "0:0"}
    assert hook.run(env, client=FakeSlurm(), cfg=cfg) == "none: exited 0"
    assert not (tmp_path / "ledger").exists()


def test_slurm_conf_is_found_beside_the_gpushare_config(tmp_path: Path) -> None:
    (tmp_path / "gpushare.toml").write_text("[oom]\n")
    (tmp_path / "slurm.conf").write_text("ClusterName=x\n")
    cfg = parse_config({}, source=str(tmp_path / "gpushare.toml"))
    assert cfg.slurm_conf_path({}) == str(tmp_path / "slurm.conf")  # the EpilogSlurmctld gets no SLURM_CONF
    assert cfg.slurm_conf_path({"SLURM_CONF": "/srv/slurm.conf"}) == "/srv/slurm.conf"
    explicit = parse_config({"slurm": {"conf": "/opt/slurm/etc/slurm.conf"}}, source=str(tmp_path / "g.toml"))
    assert explicit.slurm_conf_path({"SLURM_CONF": "/srv/slurm.conf"}) == "/opt/slurm/etc/slurm.conf"
    assert hook._client(explicit).conf_path == "/opt/slurm/etc/slurm.conf"


def test_main_always_exits_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSHARE_CONFIG", str(tmp_path / "missing.toml"))
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    assert hook.main([]) == 0  # unreadable config
    conf = tmp_path / "g.toml"
    conf.write_text(f'[oom]\nledger_dir = "{tmp_path / "l"}"\n[slurm]\nbin_dir = "{tmp_path}"\n'
                    f'[submit]\ncache_dir = "{tmp_path / "c"}"\n')
    monkeypatch.setenv("GPUSHARE_CONFIG", str(conf))
    monkeypatch.setenv("SLURM_JOB_ID", "1; rm -rf /")
    assert hook.main([]) == 0  # hostile job id
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("PATH", "")
    assert hook.main([]) == 0  # no scontrol anywhere useful


@pytest.mark.parametrize("completed_at, now, expected_sleep", [
    (100.2, 100.3, 0.75),  # same second as the revocation: sleep into the next one
    (100.9, 100.95, 0.1),
    (100.2, 101.5, None),  # already a later second: no wait
])
def test_boost_waits_for_the_second_after_slurmds_credential_revocation(completed_at, now, expected_sleep) -> None:  # type: ignore[no-untyped-def]
    """slurmd refuses a re-launch whose credential is from the revocation's second; see executor.py."""
    slept: list[float] = []
    wait_past_revocation(completed_at, lambda: now, slept.append)
    if expected_sleep is None:
        assert slept == []
    else:
        assert slept == [pytest.approx(expected_sleep)]


def test_a_requeue_that_leaves_the_job_pending_but_completing_is_boosted_only_after_completion(setup) -> None:  # type: ignore[no-untyped-def]
    """Slurm 24.11 after a slurmctld restart: requeueing the recovered FAILED job leaves it PENDING+COMPLETING,
    and a start time set then is replaced by Slurm's requeue delay when completion ends. The resume hands the
    boost to the detached finisher, which sets it once completion has ended."""
    cfg, fake, _ = setup
    fake.fields["JobState"] = "FAILED"
    requeue_hold = fake.requeue_hold

    def stale_completion(job_id: str) -> None:
        requeue_hold(job_id)
        fake.fields["JobState"] = "PENDING,COMPLETING"

    fake.requeue_hold = stale_completion
    ledger = Ledger(cfg.oom.ledger_dir)
    ledger.ensure()
    ledger.put({"job": "1", "restarts": 0, "action": "requeue", "state": "decided", "reason": "r",
                "new_gres": "gres:shard:40", "nice": 0, "oom": None, "steps": []})
    later: list[tuple[str, int]] = []
    resume_unfinished(fake, ledger, min_age_s=0, finish_later=lambda job, restarts: later.append((job, restarts)))
    assert later == [("1", 0)] and not any("starttime=now" in call for call in fake.calls)
    entry = ledger.get("1", 0)
    assert hook.finish(entry, fake, ledger, wait_s=0).startswith("requeue: job 1 still completing")
    assert not any("starttime=now" in call for call in fake.calls) and ledger.get("1", 0)["state"] == "requeued"
    fake.fields["JobState"] = "PENDING"  # slurmctld's re-kill ended the completion
    hook.finish(ledger.get("1", 0), fake, ledger, wait_s=0)
    assert [c for c in fake.calls if "starttime=now" in c] and ledger.get("1", 0)["state"] == "done"
