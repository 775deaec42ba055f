"""The node agent killed (SIGKILL) and restarted with shared jobs running (docs/reliability.md).

Two shared jobs share a GPU; the agent is killed; while it is down one of them jumps past its cap (no one
watches it); the agent is started again, as its unit does (``Restart=always``). The restarted agent must
take both jobs back from its job store with the caps they had, stop the overrun job with the backstop once
(OOM recovery then re-runs it once on a whole GPU), and charge each job's energy once: no job's share
exceeds what its GPU used, and nothing flushed before the kill is lost.

One module-scoped single-host cluster (tests/agent's AgentCluster, simulated GPUs): the fault is the node's.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.local_cluster import missing_requirements
from gpushare.agent.api import call
from gpushare.agent.store import JobStore
from gpushare.epilog.ledger import Ledger
from gpushare.epilog.records import RecordLedger
from gpushare.gres.sim_backend import SimBackend
from gpushare.slurm.gres_request import plain_gres
from gpushare.slurm.jobs import ENDED_STATES

pytestmark = [pytest.mark.slurm, pytest.mark.faults]
SIMJOB = Path(__file__).with_name("simjob.py")


def _helpers() -> Any:
    """tests/agent/conftest.py (AgentCluster, two_gpus), loaded under its own name for a module fixture."""
    spec = importlib.util.spec_from_file_location("gpushare_agent_fault_helpers", Path(__file__).with_name("conftest.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    problem = missing_requirements()
    if problem:
        pytest.skip(f"real Slurm unavailable: {problem}")
    helpers = _helpers()
    base = Path(tempfile.mkdtemp(prefix="gpushare-agent-faults-", dir="/tmp"))
    os.chmod(base, 0o755)
    toml = (f'[agent]\nstate_dir = "{base}/agent-state"\nrecords_dir = "{base}/records"\n'
            f'run_dir = "{base}/run-agent"\ndevice_backend = "sim:{base}/sim.json"\nwithhold = "none"\n'
            "metrics_port = 0\nwindow_samples = 4\nsample_period_s = 0.25\nflush_every_s = 1.0\n"
            f'log_file = "{base}/log/agent.log"\nbackstop_grace_s = 1.0\nbackstop_tolerance_mib = 256\n'
            'forecast_action = "none"\n')
    SimBackend.from_scenario(helpers.two_gpus(), base / "sim.json")
    made = helpers.AgentCluster(base, bin_dir=os.path.dirname(sys.executable), toml_extra=toml)
    try:
        made.start()
        made.start_agent()
        yield made
    finally:
        made.stop()
        shutil.rmtree(base, ignore_errors=True)


def submit(cluster: Any, out: Path, mem: str, args: str, *options: str) -> int:
    text = (f"#!/bin/sh\n#GPUSHARE mem={mem}\n"
            "env | grep -E '^SLURM_JOB_GPUS' > \"$GPUSHARE_TEST_OUT/env.$SLURM_JOB_ID\"\n"
            f"'{sys.executable}' '{SIMJOB}' {args}\n")
    export = f"--export=ALL,GPUSHARE_TEST_OUT={out},GPUSHARE_CONFIG={cluster.gpushare_conf}"
    job_id, _ = cluster.client.sbatch("-D", str(out), "-o", str(out / "job-%j.out"), export, "--gres=gpu:1",
                                      *options, script=text)
    return job_id


def test_agent_killed_with_shared_jobs_running_takes_them_back_and_stops_an_overrun_once(cluster):
    out = Path(tempfile.mkdtemp(prefix="gpushare-agent-faults-out-"))
    os.chmod(out, 0o777)
    # 4 GiB + 1 GiB margin = a 5 GiB cap each; the offender jumps to 7000 MiB 6 s in, while the agent is down
    offender = submit(cluster, out, "4G", "--mem-mib 3000 --jump-after 6 --jump-mib 7000 --seconds 12",
                      "--open-mode=append")
    neighbour = submit(cluster, out, "4G", "--mem-mib 3000 --seconds 12")
    store = JobStore(Path(cluster.agent_cfg().state_dir) / "jobs")
    ids = (str(offender), str(neighbour))
    cluster.wait_for(lambda: all((store.get(j) or {}).get("kernel_at") is not None for j in ids), 30,
                     "the agent did not see both jobs run")
    status = call(cluster.agent_socket, {"op": "status"})
    caps = {j["job"]: (j["cap_bytes"], j["mode"], j["gpus"]) for j in status["jobs"] if j["job"] in ids}
    assert len(caps) == 2 and caps[str(offender)][2] == caps[str(neighbour)][2]  # one GPU, two shares
    time.sleep(1.2)  # one more flush of the accumulators
    flushed = {j: dict((store.get(j) or {}).get("share_mj") or {}) for j in ids}

    cluster.stop_agent(signal.SIGKILL)
    try:
        cluster.wait_for(lambda: _jumped(cluster), 30, "the offender did not jump past its cap")
        time.sleep(1.0)  # longer than the backstop's grace: the overrun is due the moment the agent is back
        assert cluster.client.require_job(offender).state == "RUNNING"  # nobody stopped it while the agent was down
    finally:
        cluster.start_agent()
    back = {j["job"]: (j["cap_bytes"], j["mode"], j["gpus"]) for j in call(cluster.agent_socket, {"op": "status"})["jobs"]
            if j["job"] in ids}
    assert back == caps  # taken back from the store with the caps they had

    deadline = time.monotonic() + 120
    while True:
        job = cluster.client.require_job(offender)
        if job.state in ENDED_STATES and not job.completing and job.restarts >= 1:
            break
        assert time.monotonic() < deadline, f"offender {offender}: {job.states} restarts {job.restarts}"
        time.sleep(0.5)
    whole = "gpu:1" if cluster.client.version.held_gres_across_names else "shard:40"
    assert (job.restarts, job.state, plain_gres(job.tres_per_node)) == (1, "COMPLETED", whole), job
    assert cluster.wait_job(neighbour, 60).state == "COMPLETED"

    ledger = RecordLedger(cluster.agent_cfg().records_dir)
    cluster.wait_for(lambda: bool(ledger.get(str(offender), 1)) and bool(ledger.get(str(neighbour))), 30, "no records")
    first = ledger.get(str(offender), 0)
    assert len(first) == 1 and len(ledger.get(str(offender), 1)) == 1 and len(ledger.get(str(neighbour))) == 1
    oom = first[0]["oom"]
    assert oom["source"] == "agent-backstop" and oom["action"] == "stop" and oom["cap_bytes"] == 5 << 30
    budget = Ledger(cluster.config().oom.ledger_dir)
    assert budget.user_recoveries(0) == 1  # root's jobs here: one recovery charged to the user's daily budget
    log = (out / f"job-{offender}.out").read_text()
    assert log.count("gpushare-agent: GPU out of memory (backstop)") == 1  # stopped once
    for job_id, record in ((str(offender), first[0]), (str(neighbour), ledger.get(str(neighbour))[0])):
        for gpu, numbers in record["gpus"].items():
            assert numbers["share_j"] <= numbers["energy_j"] * 1.001, (job_id, numbers)  # never charged twice
            assert numbers["share_j"] * 1000 >= flushed[job_id].get(gpu, 0.0) * 0.999, (job_id, numbers)  # kept
    shutil.rmtree(out, ignore_errors=True)


def _jumped(cluster: Any) -> bool:
    """Whether the simulated GPUs show a process above the 5 GiB cap (only the offender ever is)."""
    state = SimBackend.open(cluster.sim_state)
    return any(isinstance(p.used_bytes, int) and p.used_bytes > 5 << 30
               for index in range(state.gpu_count()) for p in state.processes(index))


def _job_processes(job_id: int) -> list[int]:
    """slurmstepd of this job and every process carrying its id (what a node's loss takes with it)."""
    found = []
    marker = f"SLURM_JOB_ID={job_id}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            if cmdline.startswith(b"slurmstepd") and f"[{job_id}.".encode() in cmdline:
                found.append(int(entry))
            elif marker in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:
            continue
    return found


def test_a_node_lost_mid_job_leaves_slurms_outcome_and_nothing_held(cluster):
    """The GPU node lost with a shared job on it: its agent, slurmd and the job's processes killed at once
    (as a power loss would), the node set DOWN, then brought back. The job's outcome is Slurm's (NODE_FAIL,
    once: --no-requeue), no OOM recovery acts on it, and the restarted agent closes the run it restored (no
    Epilog ran for it here): it no longer tracks it, its caps file is gone, and the next job runs normally."""
    out = Path(tempfile.mkdtemp(prefix="gpushare-agent-faults-out-"))
    os.chmod(out, 0o777)
    job_id = submit(cluster, out, "4G", "--mem-mib 3000 --seconds 60", "--no-requeue")
    store = JobStore(Path(cluster.agent_cfg().state_dir) / "jobs")
    cluster.wait_for(lambda: (store.get(str(job_id)) or {}).get("kernel_at") is not None, 30, "job not seen")
    caps_file = Path(cluster.agent_cfg().run_dir) / "jobs" / f"{job_id}.json"
    assert caps_file.exists()
    node = next(name for name in cluster.pids if name.startswith("slurmd-"))
    cluster.stop_agent(signal.SIGKILL)
    slurmd = cluster.pids.pop(node)
    os.killpg(slurmd, signal.SIGKILL)
    os.waitpid(slurmd, 0)
    for pid in _job_processes(job_id):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    started = time.monotonic()
    cluster.client.run("scontrol", "update", f"nodename={node.removeprefix('slurmd-')}", "state=down",
                       "reason=lost in a fault test")
    cluster.wait_for(lambda: cluster.client.require_job(job_id).state == "NODE_FAIL"
                     and not cluster.client.require_job(job_id).completing, 60, "the job did not fail with its node")
    cluster._spawn(node, ["slurmd", "-D", "-N", node.removeprefix("slurmd-"), "-f", str(cluster.conf)])
    cluster.client.run("scontrol", "update", f"nodename={node.removeprefix('slurmd-')}", "state=resume")
    cluster.start_agent()
    cluster.wait_for(lambda: (store.get(str(job_id)) or {}).get("closed") is True, 30, "restored run not closed")
    print(f"node lost mid-job: converged {time.monotonic() - started:.1f} s after the node went down")
    assert "NODE_FAIL" in store.get(str(job_id))["lost"] and not caps_file.exists()
    assert str(job_id) not in [j["job"] for j in call(cluster.agent_socket, {"op": "status"})["jobs"]]
    lost = cluster.client.require_job(job_id)
    assert (lost.state, lost.restarts) == ("NODE_FAIL", 0)  # Slurm's outcome, applied once
    assert not Ledger(cluster.config().oom.ledger_dir).entries_for(str(job_id))  # no OOM recovery of a lost node
    cluster.wait_for(lambda: cluster.client.run("sinfo", "-h", "-n", node.removeprefix("slurmd-"), "-o", "%t").strip()
                     in ("idle", "mix", "alloc"), 60, "node not back")
    after = submit(cluster, out, "4G", "--mem-mib 1000 --seconds 2")
    assert cluster.wait_job(after, 60).state == "COMPLETED"
    shutil.rmtree(out, ignore_errors=True)
