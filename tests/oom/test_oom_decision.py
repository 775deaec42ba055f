"""OOM recovery as gather → decide → act: the decision is pure (one evidence record and the settings in), each of
its outcomes follows from the evidence record alone, and the gather fills that record from the run's files."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import os
from pathlib import Path

import pytest

from gpushare.atomic import write_json_atomic
from gpushare.config import CORROBORATE_FRACTION, Config, parse_config
from gpushare.epilog.ledger import Ledger
from gpushare.epilog.oom_evidence import gather
from gpushare.gpus import GiB
from gpushare.policy import oom_recovery
from gpushare.policy.oom_recovery import (COLLATERAL_SLACK_S, JobFacts, OomEvidence, OomVerdict, decide,
                                          log_not_kept)
from gpushare.slurm.gres_request import GresRequest
from oom_fake_slurm import FakeSlurm

OOM = OomVerdict(True, "GPU out of memory (pytorch) in /e", "pytorch", "torch.OutOfMemoryError: ...", "/e")
SHARE = 4 * GiB  # gres:shard:4
NOW = 1_800_000_000.0
PURE_IMPORTS = {"__future__", "re", "collections.abc", "dataclasses", "typing", "gpushare.config", "gpushare.gpus",
                "gpushare.slurm", "gpushare.slurm.record", "gpushare.slurm.jobs", "gpushare.slurm.hostlist",
                "gpushare.slurm.gres_request"}
IO_MODULES = {"os", "io", "pathlib", "subprocess", "socket", "time", "shutil", "fcntl", "logging", "tempfile"}


def cfg(tmp_path: Path | None = None, **oom: object) -> Config:
    agent = {"records_dir": str(tmp_path / "records")} if tmp_path else {}
    return parse_config({"oom": {"max_recoveries_per_user_day": 2, **oom}, "agent": agent,
                         "nodes": [{"names": "n1", "gpu": "a100-40gb", "count": 2}]})


def facts(record: dict | None = None, **changes: object) -> JobFacts:
    job = JobFacts(job_id="5", state="COMPLETING", exit_code=1, exit_signal=0, restarts=0,
                   gres=GresRequest.parse("gres:shard:4"), node="n1", uid=1000, gid=1000, log_paths=("/e",),
                   record={"decision": "shared", "v": 1} if record is None else record)
    return dataclasses.replace(job, **changes)


def peak(bytes_: int, **run_record: object) -> tuple[dict, ...]:
    """The node agent's run record of the run, with its measured peak on GPU 0."""
    return ({"job": "5", "restarts": 0, "gpus": {"0": {"peak_bytes": bytes_}}, **run_record},)


def neighbour(at: float = NOW - 3) -> dict:
    return {"decision": "shared", "v": 1, "collateral": {"by": "9", "gpu": 0, "at": at}}


def _imports(module: object) -> set[str]:
    tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_decide_takes_only_the_evidence_record_and_the_settings_and_imports_no_io() -> None:
    assert list(inspect.signature(decide).parameters) == ["evidence", "cfg"]
    assert _imports(oom_recovery) <= PURE_IMPORTS, _imports(oom_recovery) - PURE_IMPORTS
    import gpushare.gpus
    import gpushare.slurm.gres_request
    import gpushare.slurm.hostlist
    import gpushare.slurm.jobs
    import gpushare.slurm.record
    for module in (gpushare.gpus, gpushare.slurm.gres_request, gpushare.slurm.hostlist, gpushare.slurm.jobs,
                   gpushare.slurm.record):
        assert not {name.split(".")[0] for name in _imports(module)} & IO_MODULES, module.__name__


def test_decide_reads_no_file_the_evidence_does_not_hold(tmp_path: Path) -> None:
    """The agent's run record in ``[agent] records_dir`` would corroborate the OOM; the evidence record holds
    none, so the decision, which reads nothing itself, does not see it."""
    config = cfg(tmp_path)
    (tmp_path / "records").mkdir(mode=0o755)
    write_json_atomic(tmp_path / "records" / "5.0.json", peak(SHARE)[0])
    assert decide(OomEvidence(facts(), OOM, ended_at=NOW), config).kind == "stay_failed"
    assert decide(OomEvidence(facts(), OOM, peak(SHARE), ended_at=NOW), config).kind == "requeue"


def test_no_oom_and_a_job_not_failed_are_left_alone() -> None:
    not_oom = OomVerdict(False, "failed (exit 1) without a GPU out-of-memory message")
    assert decide(OomEvidence(facts(), not_oom, peak(SHARE)), cfg()).reason == not_oom.reason
    action = decide(OomEvidence(facts(state="CANCELLED"), OOM, peak(SHARE)), cfg())
    assert action.kind == "none" and "CANCELLED" in action.reason


def test_the_corroboration_threshold_is_the_one_the_agent_writes_its_peak_at() -> None:
    """The default ``[oom] corroborate_fraction`` is gpushare.config.CORROBORATE_FRACTION: a peak just under it
    is not enough, at it the job is requeued on a whole GPU."""
    assert cfg().oom.corroborate_fraction == CORROBORATE_FRACTION
    at = math.ceil(CORROBORATE_FRACTION * SHARE)
    below = decide(OomEvidence(facts(), OOM, peak(at - (64 << 20))), cfg())
    assert below.kind == "stay_failed" and "not corroborated" in below.reason and not below.learn
    assert f"{CORROBORATE_FRACTION:.0%}" in below.reason
    enough = decide(OomEvidence(facts(), OOM, peak(at)), cfg())
    assert enough.kind == "requeue" and enough.new_gres == "gres:shard:40" and enough.charged and enough.learn


@pytest.mark.parametrize("record, run_records, missing", [
    ({"v": 1}, peak(SHARE), "not sized by gpushare"),
    (None, (), "no measurement"),
])
def test_an_oom_the_agents_records_do_not_back_stays_failed(record: dict | None, run_records: tuple[dict, ...],
                                                            missing: str) -> None:
    action = decide(OomEvidence(facts(record), OOM, run_records), cfg())
    assert action.kind == "stay_failed" and missing in action.reason and not action.learn


def test_the_peak_in_the_jobs_record_backs_it_as_the_run_record_does() -> None:
    record = {"decision": "shared", "v": 1, "run": {"peak_gib": 4.0}}
    assert decide(OomEvidence(facts(record), OOM), cfg()).kind == "requeue"


def test_corroborate_no_trusts_the_log_alone() -> None:
    action = decide(OomEvidence(facts({"v": 1}), OOM), cfg(corroborate="no"))
    assert action.kind == "requeue" and "not checked" in action.reason


def test_the_users_daily_budget_stops_a_corroborated_requeue() -> None:
    action = decide(OomEvidence(facts(), OOM, peak(SHARE), user_recoveries=2), cfg())
    assert action.kind == "stay_failed" and "max_recoveries_per_user_day = 2" in action.reason


def test_the_ledgers_retries_bound_the_requeues() -> None:
    action = decide(OomEvidence(facts(), OOM, peak(SHARE), retries_used=1), cfg())
    assert action.kind == "stay_failed" and action.retry == 1 and "max_retries = 1" in action.reason


def test_the_release_and_the_offered_types_shape_the_larger_run() -> None:
    assert decide(OomEvidence(facts(), OOM, peak(SHARE), whole_gpu_as_gpu=True), cfg()).new_gres == "gres:gpu:1"
    mig = facts(gres=GresRequest.parse("gres:gpu:1g.5gb:1"))
    assert decide(OomEvidence(mig, OOM, peak(5 * GiB), mig_available=frozenset({"1g.5gb", "3g.20gb"})),
                  cfg()).new_gres == "gres:gpu:3g.20gb:1"


def test_a_victim_is_rerun_on_its_share_free_once_then_charged() -> None:
    free = decide(OomEvidence(facts(neighbour()), OOM, peak(1 * GiB), ended_at=NOW), cfg())
    assert free.kind == "requeue" and free.new_gres == "gres:shard:4" and not free.charged and not free.learn
    assert free.oom and free.oom["by"] == "9" and free.oom["coll"] == 1 and free.oom["n"] == 0
    charged = decide(OomEvidence(facts(neighbour()), OOM, peak(1 * GiB), free_reruns=1, ended_at=NOW), cfg())
    assert charged.kind == "requeue" and charged.charged and charged.retry == 1 and "charged" in charged.reason


def test_a_neighbours_mark_outside_its_window_is_no_excuse() -> None:
    late = NOW + cfg().agent.backstop_grace_s + COLLATERAL_SLACK_S + 1
    for ended_at in (NOW - 60, late):
        action = decide(OomEvidence(facts(neighbour(NOW)), OOM, peak(1 * GiB), ended_at=ended_at), cfg())
        assert action.kind == "stay_failed" and "not corroborated" in action.reason, ended_at


def test_a_job_over_its_own_cap_is_never_a_victim() -> None:
    """Its run record's cap (2 GiB) is below its measured peak (4 GiB) by more than the backstop's tolerance."""
    over = peak(SHARE, caps={"mem_limit_mib": 2048})
    action = decide(OomEvidence(facts(neighbour()), OOM, over, ended_at=NOW), cfg())
    assert action.kind == "requeue" and action.charged and "collateral" not in action.reason
    stopped = decide(OomEvidence(facts(neighbour()), OOM, peak(1 * GiB, oom={"source": "agent-backstop"}),
                                 ended_at=NOW), cfg())
    assert stopped.kind == "stay_failed" and "collateral" not in stopped.reason


def test_a_requeue_whose_log_cannot_be_kept_stays_failed_uncharged() -> None:
    action = log_not_kept(decide(OomEvidence(facts(), OOM, peak(SHARE)), cfg()), "EEXIST")
    assert action.kind == "stay_failed" and action.retry == 0 and "could not be kept" in action.reason


def test_gather_fills_the_record_from_the_runs_files_once(tmp_path: Path) -> None:
    """The agent's run record from a folder only root writes (none from a world-writable one), the ledger's
    counts, slurmctld's end time and the log's verdict, all in the one evidence record."""
    config = cfg(tmp_path)
    records = tmp_path / "records"
    records.mkdir(mode=0o755)
    write_json_atomic(records / "n1.5.0.json", peak(SHARE)[0])
    log = tmp_path / "err-5.txt"
    log.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")
    job = facts(log_paths=(str(log),), uid=os.geteuid(), gid=os.getegid())
    ledger = Ledger(tmp_path / "ledger")
    ledger.ensure()
    ledger.note_user_recovery(os.geteuid())
    env = {"SLURM_JOB_END_TIME": str(int(NOW))}
    evidence = gather(job, env, FakeSlurm({"JobId": "5"}), config, ledger)
    assert evidence.verdict.is_oom and evidence.verdict.family == "pytorch"
    assert [r["gpus"] for r in evidence.run_records] == [{"0": {"peak_bytes": SHARE}}]
    assert (evidence.user_recoveries, evidence.retries_used, evidence.ended_at) == (1, 0, NOW)
    assert decide(evidence, config).kind == "requeue"
    os.chmod(records, 0o777)
    assert gather(job, env, FakeSlurm({"JobId": "5"}), config, ledger).run_records == ()
