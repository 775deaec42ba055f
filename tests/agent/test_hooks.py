"""Prolog, TaskProlog and Epilog pieces against hostile input, with the agent down, and the local API."""

from __future__ import annotations

import io
import json
import os

import pytest

from gpushare.epilog.records import RecordLedger
from gpushare.epilog.slurmd_epilog import close_job
from gpushare.config import parse_config
from gpushare.gpus import GiB
from gpushare.gres.sim_backend import SimBackend
from gpushare.agent.api_server import ApiServer
from gpushare.node.api import AgentUnavailable, call
from gpushare.node.comment import merged_comment, run_summary
from gpushare.node.store import JobStore
from gpushare.prolog import task_prolog
from gpushare.node.jobs import shards_of
from gpushare.node.hook_env import job_from_env, slurm_facts
from gpushare.prolog.slurmd_prolog import register, write_caps
from gpushare.slurm.jobs import job_from_json

SCENARIO = {"version": 1, "name": "hooks", "processes": [], "gpus": [{"model": "a100-40gb"}, {"model": "a100-40gb"}]}
ENV = {"SLURM_JOB_ID": "42", "SLURM_JOB_UID": "1000", "SLURM_JOB_USER": "alice", "SLURM_JOB_GPUS": "1"}


class FakeSlurm:
    def __init__(self, js=None) -> None:
        self.js = js
        self.updates: list[tuple[str, dict]] = []

    def job(self, job):
        return job_from_json(self.js) if self.js is not None else None

    def update_job(self, job, **fields):
        self.updates.append((job, fields))


def cfg_for(tmp_path, **agent):
    return parse_config({"agent": {"state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run"),
                                   "records_dir": str(tmp_path / "records"), **agent}}).agent


@pytest.mark.parametrize("env", [
    {**ENV, "SLURM_JOB_ID": "42;reboot"}, {**ENV, "SLURM_JOB_ID": "../1"}, {**ENV, "SLURM_JOB_GPUS": ""},
    {**ENV, "SLURM_JOB_GPUS": "0,$(id)"}, {**ENV, "SLURM_JOB_GPUS": "GPU-1234"}, {}])
def test_hook_env_refuses_anything_odd(env):
    assert job_from_env(env) is None


def test_hook_env_and_slurm_record():
    job = job_from_env({**ENV, "SLURM_JOB_USER": "bob; rm -rf /"})
    assert job.gpus == [1] and job.user == "" and job.uid == 1000
    record = 'gpushare:{"v":1,"decision":"shared","est_gib":4.0,"margin_gib":1.0}'
    facts = slurm_facts(job, job_from_json({"tres_per_node": "gres:shard:5", "admin_comment": record, "restart_cnt": 1}))
    assert facts["shared"] and facts["shards"] == 5 and facts["est_gib"] == 4.0 and facts["restarts"] == 1
    hostile = slurm_facts(job, job_from_json({"tres_per_node": 5, "admin_comment": 'gpushare:{"decision":"shared","est_gib":"9e9"}'}))
    assert not hostile["shared"] and hostile["est_gib"] is None
    assert shards_of("gres:gpu:1") is None and shards_of("gres/shard:12") == 12


@pytest.mark.parametrize(("tres", "shards"), [
    ("gres:shard:5", 5), ("gres:shard:tesla:5", 5),  # 22.05, untyped and typed
    ("gres/shard:5", 5), ("gres/shard:tesla:5", 5),  # 23.02+ (24.11, 26.05)
    ("shard:5", 5), ("shard:a100:5", 5),  # as typed to --gres
    ("gres/gpu:1,gres/shard:3g.20gb:12", 12), (" gres:shard:0 ", 0),
    ("gres:gpu:1", None), ("gres/gpu:tesla:2", None), ("", None), (None, None),
    ("gres:shard:5;rm -rf /", None), ("gres:shard:" + "9" * 9, None),  # not understood / past a registration's bound
])
def test_shards_of_reads_every_form_slurm_prints(tres, shards):
    assert shards_of(tres) == shards
    assert shards_of(job_from_json({"tres_per_node": tres or ""}).gres_per_node) == shards


def test_task_prolog_exports_only_known_safe_values(tmp_path):
    write_caps(str(tmp_path), "42", {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=5120M",
                                     "CUDA_MPS_PIPE_DIRECTORY": "/run/x; touch /tmp/pwned",
                                     "LD_PRELOAD": "/tmp/evil.so", "GPUSHARE_MEMORY_FRACTION": "0.125\nexport X=1"})
    assert task_prolog.exports({"SLURM_JOB_ID": "42"}, str(tmp_path)) == [
        "export CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=5120M"]
    assert task_prolog.exports({"SLURM_JOB_ID": "43"}, str(tmp_path)) == []
    assert task_prolog.exports({"SLURM_JOB_ID": "../42"}, str(tmp_path)) == []


def test_task_prolog_prints_nothing_on_error(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUSHARE_CONFIG", str(tmp_path / "missing.toml"))
    out = io.StringIO()
    assert task_prolog.main(out=out) == 0 and out.getvalue() == ""


def test_prolog_and_epilog_without_agent(tmp_path, clock):
    cfg = cfg_for(tmp_path)
    sim = SimBackend.from_scenario(SCENARIO, clock=clock)
    record = 'gpushare:{"v":1,"decision":"shared","est_gib":4.0,"margin_gib":1.0}'
    slurm = FakeSlurm({"tres_per_node": "gres:shard:5", "admin_comment": record, "exit_code": 256,
                       "job_state": "COMPLETED"})
    assert register(ENV, cfg, client=slurm, backend=sim) is None  # no agent ever deployed here: nothing
    (tmp_path / "state").mkdir()  # deployed (state directory exists), agent down right now
    exports = register(ENV, cfg, client=slurm, backend=sim)
    assert exports["GPUSHARE_CAPS_MODE"] == "fraction"  # no agent, no MPS daemon to vouch for
    assert exports["GPUSHARE_MEM_LIMIT_MIB"] == "5120"
    entry = JobStore(tmp_path / "state" / "jobs").get("42")
    assert entry["registered_by"] == "prolog" and entry["start_energy_mj"]["1"] is not None
    clock.advance(100)
    done = close_job(ENV, cfg, client=slurm, backend=sim)
    assert done["closed_by"] == "epilog" and done["ttfk_s"] is None
    assert done["gpus"]["1"]["energy_j"] == pytest.approx(60 * 100)  # idle GPU for 100 s at 60 W
    assert done["exit_code"] == 1 and done["exit_signal"] == 0
    assert RecordLedger(cfg.records_dir).get("42")[0]["job"] == "42"
    text = slurm.updates[0][1]["admincomment"]
    assert json.loads(text[len("gpushare:"):])["run"]["energy_j"] == pytest.approx(6000.0)
    assert JobStore(tmp_path / "state" / "jobs").get("42") is None
    assert not (tmp_path / "run" / "jobs" / "42.json").exists()


def test_epilog_for_unregistered_job_writes_nothing(tmp_path):
    cfg = cfg_for(tmp_path)
    assert close_job(ENV, cfg, client=FakeSlurm(None), backend=object()) is None
    assert list(RecordLedger(cfg.records_dir).all()) == []


def test_admin_comment_keeps_foreign_comments_and_size():
    record = {"node": "n1", "ttfk_s": 2.5, "gpus": {"0": {"energy_j": 10.0, "share_j": 5.0, "peak_bytes": GiB}}}
    assert merged_comment("site: do not touch", run=run_summary(record)) is None
    text = merged_comment('gpushare:{"v":1,"decision":"shared","why":"' + "x" * 2000 + '"}', run=run_summary(record))
    assert len(text) <= 900 and json.loads(text[9:])["run"] == {"node": "n1", "ttfk_s": 2.5, "energy_j": 10.0,
                                                               "share_j": 5.0, "peak_gib": 1.0,
                                                               "gpus": {"0": [1.0, None]}}  # no SMACT series


def test_api_roundtrip_and_root_only(tmp_path):
    path = tmp_path / "api" / "agent.sock"
    server = ApiServer(path, lambda req: {"ok": True, "echo": req["op"]}).start()
    try:
        assert call(path, {"op": "ping"}) == {"ok": True, "echo": "ping"}
        assert oct(os.stat(path).st_mode & 0o777) == "0o600" and oct(os.stat(path.parent).st_mode & 0o777) == "0o700"
        import socket

        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(path))
            sock.sendall(b"not json\n")
            assert json.loads(sock.recv(4096))["ok"] is False
    finally:
        server.stop()
    with pytest.raises(AgentUnavailable):
        call(path, {"op": "ping"}, timeout_s=0.5)
    strict = ApiServer(path, lambda req: {"ok": True}, allowed_uids=(54321,)).start()
    try:
        reply = call(path, {"op": "ping"})
        assert reply["ok"] is False and "root only" in reply["error"]
    finally:
        strict.stop()
