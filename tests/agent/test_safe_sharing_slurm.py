"""Safe sharing on a real local Slurm with simulated GPUs: framework caps for two users' jobs on one GPU,
and the agent's backstop stopping a job that grows past its cap while its neighbour completes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from devcluster.local_cluster import ensure_login_user
from gpushare.epilog.ledger import Ledger
from gpushare.epilog.records import RecordLedger
from gpushare.slurm.gres_request import plain_gres
from gpushare.slurm.record import parse as parse_record
from gpushare.slurm.jobs import ENDED_STATES
from gpushare.estimator_cli.allocator_config import AllocatorConfig

pytestmark = pytest.mark.slurm
SIMJOB = Path(__file__).with_name("simjob.py")


def script(mem: str, args: str) -> str:
    return (f"#!/bin/sh\n#GPUSHARE mem={mem}\n"
            "env | grep -E '^(CUDA_|GPUSHARE_|SLURM_JOB_GPUS|PYTORCH_|XLA_)' | sort > \"$GPUSHARE_TEST_OUT/env.$SLURM_JOB_ID\"\n"
            f"'{sys.executable}' '{SIMJOB}' {args}\n")


def submit(cluster, out: Path, text: str, *args: str) -> int:
    export = f"--export=ALL,GPUSHARE_TEST_OUT={out},GPUSHARE_CONFIG={cluster.gpushare_conf}"
    job_id, _ = cluster.client.sbatch("-D", str(out), "-o", str(out / "job-%j.out"), export, *args, script=script_of(text))
    return job_id


def script_of(text: str) -> str:
    return text


def job_env(out: Path, job_id: int) -> dict[str, str]:
    lines = (out / f"env.{job_id}").read_text().split("\n")
    return dict(line.split("=", 1) for line in lines if "=" in line)


@pytest.fixture
def out_dir():
    """Job output directory every user can write (pytest's own base directory is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="gpushare-safe-"))
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def open_to_other_users(cluster) -> None:
    """Let a second user's job reach the test cluster's files (the cluster lives outside pytest's
    root-only base directory, as every agent_cluster is): the config and caps (read), the
    simulated GPU state (its process registers itself there) and the hooks' log."""
    os.chmod(cluster.base, 0o777)  # the simulated state is replaced atomically (temp file + rename)
    for name in ("sim.json", "sim.json.lock"):
        path = cluster.base / name
        path.touch()
        os.chmod(path, 0o666)
    log = cluster.base / "log" / "hooks.log"
    log.touch()
    os.chmod(log, 0o666)


def torch_accepts(value: str) -> None:
    """PyTorch's own allocator-settings parser, in a fresh interpreter (as the job would run it)."""
    code = "import sys, torch; torch._C._accelerator_setAllocatorSettings(sys.argv[1])"
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code, value], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_two_users_jobs_on_one_gpu_get_framework_caps(agent_cluster, out_dir, monkeypatch):
    pytest.importorskip("torch")
    other = ensure_login_user()  # with a login shell: 26.05 holds a --uid job whose login environment fails
    cluster = agent_cluster(withhold="none", extra='collocation = "fraction"')
    open_to_other_users(cluster)
    # the users' own allocator settings, in the submitting environment (--export=ALL carries them)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256,roundup_power2_divisions:[256:1,>:4]")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.05")
    a = submit(cluster, out_dir, script("4.5G", "--mem-mib 3000 --seconds 4"), "--gres=gpu:1")
    b = submit(cluster, out_dir, script("10G", "--mem-mib 9000 --seconds 4"), "--gres=gpu:1",
               f"--uid={other.pw_uid}", f"--gid={other.pw_gid}")
    for job in (a, b):
        log = out_dir / f"job-{job}.out"
        assert cluster.wait_job(job, 90).state == "COMPLETED", log.read_text() if log.exists() else "no log"
    assert cluster.client.require_job(b).user_id == other.pw_uid and cluster.client.require_job(a).user_id == 0
    env_a, env_b = job_env(out_dir, a), job_env(out_dir, b)
    assert env_a["SLURM_JOB_GPUS"] == env_b["SLURM_JOB_GPUS"]  # one GPU, two users
    for env, need_mib in ((env_a, 5.5 * 1024), (env_b, 11 * 1024)):
        assert env["GPUSHARE_CAPS_MODE"] == "fraction" and "CUDA_MPS_PIPE_DIRECTORY" not in env
        fraction = float(env["GPUSHARE_MEMORY_FRACTION"])
        assert fraction == pytest.approx((need_mib - 612) / 40960, abs=1e-6)  # less the A100's context and kernels
        value = env["PYTORCH_CUDA_ALLOC_CONF"]
        torch_accepts(value)  # PyTorch's parser takes the merged setting whole
        parsed = AllocatorConfig.from_env_string(value)  # and the CUDA allocator's keys, by our model of it
        assert parsed.per_process_memory_fraction == pytest.approx(fraction)
        assert parsed.max_split_size == 256 << 20 and parsed.roundup_power2_divisions[0] == 1  # user's kept
        assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.05"  # the user's stricter JAX fraction stays
        assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def _stopped_then(cluster, job_id: int, timeout_s: float = 120.0):  # type: ignore[no-untyped-def]
    """The job after the backstop stopped its first run and OOM recovery decided (a re-run, or none)."""
    deadline = time.monotonic() + timeout_s
    job = None
    while time.monotonic() < deadline:
        job = cluster.client.require_job(job_id)
        ended = job.state in ENDED_STATES and not job.completing
        if ended and (job.restarts >= 1 or job.state == "FAILED"):
            time.sleep(2.0)  # a recovery decided by EpilogSlurmctld shows as a requeue within a moment
            again = cluster.client.require_job(job_id)
            if (again.states, again.restarts) == (job.states, job.restarts):
                return again
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not finished in {timeout_s:.0f} s: {job}")


@pytest.mark.version_sensitive("the OOM rerun is gpu:1 where a held job may change GRES name (24.11+), shard:40 on 22.05")
def test_backstop_stops_a_job_growing_past_its_cap_while_its_neighbour_completes(agent_cluster, out_dir):
    cluster = agent_cluster(withhold="none", extra='backstop_grace_s = 1.0\nbackstop_tolerance_mib = 256\n'
                                                  'forecast_action = "none"')
    # 4 GiB + 1 GiB margin = 5 GiB cap; the offender starts at 3000 MiB and leaks 1 GiB/s
    offender = submit(cluster, out_dir, script("4G", "--mem-mib 3000 --grow-mib-per-s 1024 --seconds 30"),
                      "--gres=gpu:1", "--open-mode=append")  # a rerun keeps the first run's message
    neighbour = submit(cluster, out_dir, script("4G", "--mem-mib 3000 --seconds 10"), "--gres=gpu:1")
    # stopped by the backstop, an OOM of its own, corroborated by the peak the agent wrote into its
    # AdminComment before stopping it: recovery re-runs it once on a whole GPU, where it completes
    after = _stopped_then(cluster, offender)
    whole = "gpu:1" if cluster.client.version.held_gres_across_names else "shard:40"  # docs/compatibility.md
    assert (after.restarts, after.state, plain_gres(after.tres_per_node)) == (1, "COMPLETED", whole), after
    assert cluster.wait_job(neighbour, 60).state == "COMPLETED"
    ledger = RecordLedger(cluster.agent_cfg().records_dir)
    cluster.wait_for(lambda: bool(ledger.get(str(offender), 0)) and bool(ledger.get(str(neighbour))), 20, "no record")
    oom = ledger.get(str(offender), 0)[0]["oom"]  # the first run's record; a rerun has its own
    if after.restarts:  # the rerun was capped at its whole-GPU grant, not at the old estimate
        cluster.wait_for(lambda: bool(ledger.get(str(offender), 1)), 20, "no record of the rerun")
        rerun = ledger.get(str(offender), 1)
        assert rerun[0].get("oom") is None and rerun[0]["caps"]["mem_limit_mib"] in (None, 40 * 1024)
    assert oom["source"] == "agent-backstop" and oom["action"] == "stop"
    assert str(oom["gpu"]) == job_env(out_dir, neighbour)["SLURM_JOB_GPUS"]  # it was stopped beside the neighbour
    assert oom["cap_bytes"] == 5 << 30 and oom["peak_bytes"] > (5 << 30) + (256 << 20)
    assert ledger.get(str(neighbour))[0].get("oom") is None
    log = (out_dir / f"job-{offender}.out").read_text()
    assert "gpushare-agent: GPU out of memory (backstop)" in log and f"job {offender} stopped" in log


@pytest.mark.version_sensitive("the OOM rerun is gpu:1 where a held job may change GRES name (24.11+), shard:40 on 22.05")
def test_a_framework_oom_near_its_share_is_recovered_from_the_job_record_alone(agent_cluster, out_dir):
    """Shipped defaults ([oom] corroborate = "yes"). A job that fills 4.2 of its 5 GiB share and ends with
    PyTorch's own OOM (below its cap: the backstop never acts) is corroborated by the peak the agent wrote into
    its AdminComment while it ran. The controller's EpilogSlurmctld runs with a configuration whose records
    directory is empty, as on a controller host that cannot read a GPU node's disk: the evidence comes through
    Slurm or not at all."""
    cluster = agent_cluster(withhold="none")
    controller_without_node_records(cluster)
    job = submit(cluster, out_dir, script("4G", "--mem-mib 4300 --seconds 4 --oom-first-run"), "--gres=gpu:1",
                 "--open-mode=append")
    after = _stopped_then(cluster, job)
    whole = "gpu:1" if cluster.client.version.held_gres_across_names else "shard:40"  # docs/compatibility.md
    log = (out_dir / f"job-{job}.out").read_text()
    assert (after.restarts, after.state, plain_gres(after.tres_per_node)) == (1, "COMPLETED", whole), log
    assert "CUDA out of memory" in log
    oom_log = (cluster.base / "log" / "oom.log").read_text()
    assert "measured peak 4.2 GiB of a 5.0 GiB share" in oom_log, oom_log[-2000:]


def controller_without_node_records(cluster) -> None:  # type: ignore[no-untyped-def]
    """EpilogSlurmctld reads its own gpushare.toml, whose ``[agent] records_dir`` is an empty directory."""
    empty = cluster.base / "controller-records"
    empty.mkdir(mode=0o755, exist_ok=True)
    node_records = cluster.agent_cfg().records_dir
    text = cluster.gpushare_conf.read_text().replace(f'records_dir = "{node_records}"', f'records_dir = "{empty}"')
    assert str(empty) in text
    controller_conf = cluster.base / "etc" / "gpushare-controller.toml"
    controller_conf.write_text(text)
    wrapper = cluster.base / "bin" / "gpushare-epilog-slurmctld"
    wrapper.write_text(wrapper.read_text().replace(str(cluster.gpushare_conf), str(controller_conf)))


def test_forecast_requeues_a_leaking_job_before_it_reaches_its_cap(agent_cluster, out_dir):
    cluster = agent_cluster(withhold="none", extra='forecast_action = "requeue"\nforecast_horizon_s = 30.0\n'
                                                  'forecast_window = 60\nforecast_confirm = 3\n'
                                                  'backstop_grace_s = 600.0')
    # cap 5 GiB (4 GiB + 1 GiB margin); 2000 MiB + 150 MiB/s reaches it after about 21 s
    job = submit(cluster, out_dir, script("4G", "--mem-mib 2000 --grow-mib-per-s 150 --seconds 60"), "--gres=gpu:1")
    ledger = RecordLedger(cluster.agent_cfg().records_dir)
    try:
        cluster.wait_for(lambda: bool(ledger.get(str(job), 0)), 40, "the first run never ended")
        first = ledger.get(str(job), 0)[0]
        forecast = first["forecast"]
        assert forecast["source"] == "agent-forecast" and forecast["action"] == "requeue"
        assert forecast["outcome"] == "requeued"
        assert first.get("oom") is None  # requeued before it reached its cap: an OOM avoided
        gpu = job_env(out_dir, job)["SLURM_JOB_GPUS"]
        assert first["gpus"][gpu]["peak_bytes"] < 5 << 30
        again = cluster.client.require_job(job)
        assert again.restarts >= 1
        assert "shard:" in again.tres_per_node and not again.tres_per_node.endswith("shard:5")  # a larger share
        log = (out_dir / f"job-{job}.out").read_text()
        assert "forecast to run out of its GPU memory share" in log
    finally:
        cluster.client.run("scancel", str(job), check=False)


@pytest.mark.hostile
def test_another_users_forged_job_id_and_a_dropped_job_id_are_stopped_as_their_own_jobs(agent_cluster, out_dir):
    """Without job cgroups (proctrack/linuxproc, as here) a process's SLURM_JOB_ID is its own to set (issue 22,
    attack 2). Another user's job runs a process exporting SLURM_JOB_ID=<victim> with 8 GiB on the victim's
    GPU: it is its own job's memory, so that job is stopped and the victim completes unbilled. Then a job's
    ``env -u SLURM_JOB_ID`` process with 20 GiB on a 5 GiB cap: stopped all the same."""
    other = ensure_login_user()
    cluster = agent_cluster(withhold="none", extra='backstop_grace_s = 1.0\nbackstop_tolerance_mib = 256\n'
                                                  'forecast_action = "none"')
    open_to_other_users(cluster)
    as_other = ("--gres=gpu:1", "--no-requeue", f"--uid={other.pw_uid}", f"--gid={other.pw_gid}")
    victim = submit(cluster, out_dir, script("4G", "--mem-mib 3000 --seconds 12"), "--gres=gpu:1")
    forger = submit(cluster, out_dir, script("4G", "--mem-mib 8192 --seconds 30").replace(
        f"'{sys.executable}'", f"SLURM_JOB_ID={victim} '{sys.executable}'"), *as_other)
    assert cluster.wait_job(victim, 90).state == "COMPLETED", (out_dir / f"job-{victim}.out").read_text()
    assert cluster.wait_job(forger, 60).state != "COMPLETED"
    ledger = RecordLedger(cluster.agent_cfg().records_dir)
    cluster.wait_for(lambda: bool(ledger.get(str(victim))) and bool(ledger.get(str(forger))), 20, "no record")
    gpu = job_env(out_dir, victim)["SLURM_JOB_GPUS"]
    assert job_env(out_dir, forger)["SLURM_JOB_GPUS"] == gpu  # one GPU, two users
    mine = ledger.get(str(victim))[0]
    assert mine.get("oom") is None and mine["gpus"][gpu]["peak_bytes"] < 4 << 30  # never billed the 8 GiB
    assert ledger.get(str(forger))[0]["oom"]["peak_bytes"] >= 8 << 30

    started = time.monotonic()
    escaped = submit(cluster, out_dir, script("4G", "--mem-mib 20000 --seconds 40").replace(
        f"'{sys.executable}'", f"env -u SLURM_JOB_ID '{sys.executable}'"), *as_other)
    assert cluster.wait_job(escaped, 90).state != "COMPLETED" and time.monotonic() - started < 40
    cluster.wait_for(lambda: bool(ledger.get(str(escaped))), 20, "no record")
    oom = ledger.get(str(escaped))[0]["oom"]
    assert oom["source"] == "agent-backstop" and oom["action"] == "stop" and oom["peak_bytes"] >= 19 << 30


@pytest.mark.hostile
def test_a_lane_job_that_never_joins_its_lane_is_stopped_at_its_charge(agent_cluster, out_dir):
    """``#GPUSHARE lanes`` with a 1 + 4 GiB estimate is charged shard:4 (persistent + half its ephemeral +
    margin); a job that never joins its lane (no ``import torch``, as ``python -S`` would) and holds 5 GiB,
    under its 5.5 GiB full cap, is stopped at its charge (issue 22, attack 3)."""
    cluster = agent_cluster(withhold="none", extra='backstop_grace_s = 1.0\nbackstop_tolerance_mib = 256\n'
                                                  'forecast_action = "none"')
    (out_dir / "est.json").write_text(json.dumps({"targets": [{"gpu": "a100-40gb", "peak_total_bytes": 5 << 30,
                                                               "persistent_bytes": 1 << 30,
                                                               "ephemeral_bytes": 4 << 30}]}))
    text = ("#!/bin/sh\n#GPUSHARE lanes\n#GPUSHARE estimate=est.json\n"
            f"'{sys.executable}' '{SIMJOB}' --mem-mib 5120 --seconds 30\n")
    started = time.monotonic()
    job = submit(cluster, out_dir, text, "--gres=gpu:1", "--no-requeue")
    assert cluster.wait_job(job, 90).state != "COMPLETED" and time.monotonic() - started < 30
    record = parse_record(cluster.client.require_job(job).admin_comment) or {}
    assert plain_gres(record["new"]) == "shard:4" and record["lanes"] == {"p_gib": 1.0, "e_gib": 4.0}
    ledger = RecordLedger(cluster.agent_cfg().records_dir)
    cluster.wait_for(lambda: bool(ledger.get(str(job))), 20, "no record")
    oom = ledger.get(str(job))[0]["oom"]
    assert oom["lane"] == "off-turn" and oom["cap_bytes"] == 4 << 30 and oom["action"] == "stop"


@pytest.mark.hostile
def test_the_victim_of_a_neighbours_overrun_is_requeued_on_its_share_at_no_cost(agent_cluster, out_dir):
    """A neighbour drops its framework caps and jumps to 30 GiB on a 5 GiB cap; the job beside it (6 GiB) fails
    to allocate 5 GiB more inside its own 11 GiB share, 4 GiB being free. (A full GPU would have the offender
    stopped at the agent's first sample; here it runs out its grace period.) The agent saw the neighbour over its cap, so the victim's
    OOM is collateral: requeued at once on the same share, not charged to its user's daily budget, the
    offender named; the rerun completes (issue 22, attack 4)."""
    cluster = agent_cluster(withhold="none", extra='backstop_grace_s = 4.0\nbackstop_tolerance_mib = 256\n'
                                                  'forecast_action = "none"')
    offender = submit(cluster, out_dir, script("4G", "--mem-mib 3000 --jump-after 2 --jump-mib 30720 --seconds 30"),
                      "--gres=gpu:1", "--no-requeue")
    victim = submit(cluster, out_dir, script("10G", "--mem-mib 6144 --alloc-after 3.5 --alloc-mib 5120 --seconds 6"),
                    "--gres=gpu:1", "--open-mode=append")
    after = _stopped_then(cluster, victim)
    log = (out_dir / f"job-{victim}.out").read_text()
    assert "CUDA out of memory" in log, log  # the first run really failed beside the offender
    assert (after.restarts, after.state, plain_gres(after.tres_per_node)) == (1, "COMPLETED", "shard:11"), after
    assert cluster.wait_job(offender, 60).state != "COMPLETED"
    ledger = Ledger(cluster.config().oom.ledger_dir)
    entry = ledger.get(str(victim), 0)
    assert entry["action"] == "requeue" and "collateral" in entry["reason"] and f"job {offender}" in entry["reason"]
    assert entry["oom"]["by"] == str(offender) and entry["oom"]["coll"] == 1 and entry["oom"]["n"] == 0
    assert ledger.user_recoveries(0) == 0  # the victim's user paid nothing
    assert "does not count against your OOM recoveries" in log
