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
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devcluster.local_cluster import missing_requirements
from devcluster.processes import scaled
from gpushare.node.api import call
from gpushare.node.store import JobStore
from gpushare.epilog.ledger import Ledger
from gpushare.epilog.records import RecordLedger
from gpushare.gres.sim_backend import SimBackend
from gpushare.slurm.gres_request import plain_gres
from gpushare.slurm.client import SlurmError
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
    # The agent's state directory on a small filesystem of its own (test_a_full_state_disk_...), mounted
    # before the daemons start: a chroot release's private mount namespaces copy it (their binds are
    # recursive), and all of them see the one tmpfs, so filling it from here fills it for every process.
    (base / "agent-state").mkdir()
    made.state_tmpfs = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs",
                                       str(base / "agent-state")], capture_output=True).returncode == 0
    try:
        made.start()
        made.start_agent()
        yield made
    finally:
        made.stop()
        if made.state_tmpfs:
            subprocess.run(["umount", "-l", str(base / "agent-state")], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def submit(cluster: Any, out: Path, mem: str, args: str, *options: str) -> int:
    text = (f"#!/bin/sh\n#GPUSHARE mem={mem}\n"
            "env | grep -E '^SLURM_JOB_GPUS' > \"$GPUSHARE_TEST_OUT/env.$SLURM_JOB_ID\"\n"
            f"'{sys.executable}' '{SIMJOB}' {args}\n")
    export = f"--export=ALL,GPUSHARE_TEST_OUT={out},GPUSHARE_CONFIG={cluster.gpushare_conf}"
    job_id, _ = cluster.client.sbatch("-D", str(out), "-o", str(out / "job-%j.out"), export, "--gres=gpu:1",
                                      *options, script=text)
    return job_id


@pytest.mark.version_sensitive("the OOM rerun is gpu:1 where a held job may change GRES name (24.11+), shard:40 on 22.05")
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

    deadline = time.monotonic() + scaled(120)
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


def _job_processes(cluster: Any, job_id: int) -> list[int]:
    """slurmstepd of this job and every process carrying its id (what a node's loss takes with it), among this
    cluster's own processes: job ids start at 1 in every test cluster, and another session's job 3 must live."""
    found = []
    marker = f"SLURM_JOB_ID={job_id}".encode()
    for pid in cluster.leftover_pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if cmdline.startswith(b"slurmstepd") and f"[{job_id}.".encode() in cmdline:
                found.append(pid)
            elif marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
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
    cluster.wait_for(lambda: (store.get(str(job_id)) or {}).get("kernel_at") is not None, 30,
                     "the agent's store to show the job's first kernel", seen=lambda: store.get(str(job_id)))
    caps_file = Path(cluster.agent_cfg().run_dir) / "jobs" / f"{job_id}.json"
    assert caps_file.exists()
    node = next(name for name in cluster.pids if name.startswith("slurmd-"))
    cluster.stop_agent(signal.SIGKILL)
    slurmd = cluster.pids.pop(node)
    os.killpg(slurmd, signal.SIGKILL)
    os.waitpid(slurmd, 0)
    for pid in _job_processes(cluster, job_id):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    started = time.monotonic()
    cluster.client.run("scontrol", "update", f"nodename={node.removeprefix('slurmd-')}", "state=down",
                       "reason=lost in a fault test")
    cluster.wait_for(lambda: cluster.client.require_job(job_id).state == "NODE_FAIL"
                     and not cluster.client.require_job(job_id).completing, 60, "the job to end NODE_FAIL with its node",
                     seen=lambda: cluster.client.require_job(job_id).states)
    cluster._spawn(node, ["slurmd", "-D", "-N", node.removeprefix("slurmd-"), "-f", str(cluster.conf)])
    try:
        cluster.client.run("scontrol", "update", f"nodename={node.removeprefix('slurmd-')}", "state=resume")
    except SlurmError:  # slurmd's registration may have returned it first (ReturnToService): not DOWN any more
        assert "DOWN" not in cluster.client.node_states()[node.removeprefix("slurmd-")].upper()
    cluster.start_agent()
    cluster.wait_for(lambda: "lost" in (store.get(str(job_id)) or {}), 30,  # closed, then lost
                     "the restarted agent to close the restored run (a 'lost' entry)", seen=lambda: store.get(str(job_id)))
    print(f"node lost mid-job: converged {time.monotonic() - started:.1f} s after the node went down")
    assert "NODE_FAIL" in store.get(str(job_id))["lost"] and not caps_file.exists()
    assert str(job_id) not in [j["job"] for j in call(cluster.agent_socket, {"op": "status"})["jobs"]]
    lost = cluster.client.require_job(job_id)
    assert (lost.state, lost.restarts) == ("NODE_FAIL", 0)  # Slurm's outcome, applied once
    assert not Ledger(cluster.config().oom.ledger_dir).entries_for(str(job_id))  # no OOM recovery of a lost node
    node_state = lambda: cluster.client.run("sinfo", "-h", "-n", node.removeprefix("slurmd-"), "-o", "%t").strip()  # noqa: E731
    cluster.wait_for(lambda: node_state() in ("idle", "mix", "alloc"), 60, "the node back in service", seen=node_state)
    after = submit(cluster, out, "4G", "--mem-mib 1000 --seconds 2")
    assert cluster.wait_job(after, 60).state == "COMPLETED"
    shutil.rmtree(out, ignore_errors=True)


def test_a_full_state_disk_fails_open_says_so_once_and_recovers(cluster):
    """The agent's state directory (its job store) on a full filesystem: a shared job still registers, runs
    with its caps, is watched by the agent and ends with its full record; the agent says once that its store
    cannot be written; no torn or temporary file is left; once space returns the next job's entry is written
    again, and the entry kept in memory meanwhile reaches the disk, with nothing restarted."""
    if not cluster.state_tmpfs:
        pytest.skip("a tmpfs cannot be mounted here (needs root)")
    state = Path(cluster.agent_cfg().state_dir)
    jobs_dir = state / "jobs"
    jobs_dir.mkdir(exist_ok=True)
    agent_log = cluster.base / "log" / "agent.log"
    seen = agent_log.read_text(errors="replace") if agent_log.exists() else ""
    for filler in ("filler", "filler-2"):  # the second takes what a write under way when the first ended freed
        subprocess.run(["dd", "if=/dev/zero", f"of={state}/{filler}", "bs=4k"], capture_output=True)
        time.sleep(0.5)
    out = Path(tempfile.mkdtemp(prefix="gpushare-agent-faults-out-"))
    os.chmod(out, 0o777)
    store = JobStore(jobs_dir)
    ledger = RecordLedger(cluster.agent_cfg().records_dir)
    try:
        full = submit(cluster, out, "4G", "--mem-mib 3000 --seconds 6")
        cluster.wait_for(lambda: cluster.client.require_job(full).state == "RUNNING", 30, "job did not start")
        cluster.wait_for(lambda: any(j["job"] == str(full) and j.get("kernel_at") is not None
                                     for j in call(cluster.agent_socket, {"op": "status"})["jobs"]), 30,
                         "the agent does not watch the job whose entry it could not write")
        tracked = next(j for j in call(cluster.agent_socket, {"op": "status"})["jobs"] if j["job"] == str(full))
        assert tracked["cap_bytes"] == 5 << 30 and tracked["mode"] != "none", tracked  # its caps, as usual
        assert store.get(str(full)) is None  # the disk is full: nothing was written, nothing half-written
        time.sleep(2.5)  # a couple of flushes against the full disk
        assert cluster.wait_job(full, 60).state == "COMPLETED"
        cluster.wait_for(lambda: bool(ledger.get(str(full))), 30, "no record for the job")
        record = ledger.get(str(full))[0]
        assert max(n.get("peak_bytes") or 0 for n in record["gpus"].values()) >= 3000 << 20, record  # measured
        assert record["closed_by"] == "agent", record
        leftovers = [p.name for p in jobs_dir.iterdir()
                     if p.name.endswith(".tmp") or (p.name.startswith(f"{full}.") and p.suffix != ".lock")]
        assert leftovers == [], leftovers  # no entry, no temporary file
        log = agent_log.read_text(errors="replace")[len(seen):]
        assert log.count("job store not writable") == 1, log[-3000:]  # said once, not once per flush
        assert "Traceback" not in log, log[-3000:]

        for filler in ("filler", "filler-2"):
            (state / filler).unlink()  # space returns
        later = submit(cluster, out, "4G", "--mem-mib 1000 --seconds 3")
        cluster.wait_for(lambda: (store.get(str(later)) or {}).get("kernel_at") is not None, 30,
                         "no store entry after space returned")
        assert cluster.wait_job(later, 60).state == "COMPLETED"
        cluster.wait_for(lambda: bool(ledger.get(str(later))), 30, "no record after space returned")
        log = agent_log.read_text(errors="replace")[len(seen):]
        assert log.count("job store not writable") == 1 and log.count("job store writable again") == 1, log[-3000:]
    finally:
        for filler in ("filler", "filler-2"):
            (state / filler).unlink(missing_ok=True)
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.torch  # the lane jobs' processes import torch
def test_lane_jobs_keep_their_lane_across_an_agent_kill_and_count_once(cluster):
    """Two ``#GPUSHARE lanes`` jobs taking turns on one GPU when the agent is SIGKILLed and started again. The
    lanes live in the agent's memory only: each job's lanes client notices the lost session, joins its lane
    again on the new agent and goes on taking turns (no refusal, lanes never switched off); the new agent
    has each job once on one lane, every step runs once, turns never overlap again, and each job ends with
    one record."""
    pytest.importorskip("torch")
    sys.path.insert(0, str(Path(__file__).parent))
    from lane_log import completed_turns

    out = Path(tempfile.mkdtemp(prefix="gpushare-agent-faults-lanes-"))
    os.chmod(out, 0o777)
    (out / "est.json").write_text('{"targets": [{"gpu": "a100-40gb", "peak_total_bytes": 3221225472, '
                                  '"persistent_bytes": 1073741824, "ephemeral_bytes": 2147483648}]}')
    text = ("#!/bin/sh\n#GPUSHARE lanes\n#GPUSHARE estimate=est.json\n"
            f"exec '{sys.executable}' '{Path(__file__).with_name('lane_worker.py')}' "
            "\"$GPUSHARE_TEST_OUT/$SLURM_JOB_ID.log\" 30 0.1\n")
    export = f"--export=ALL,GPUSHARE_TEST_OUT={out},GPUSHARE_CONFIG={cluster.gpushare_conf}"
    jobs = [cluster.client.sbatch("-D", str(out), "-o", str(out / "job-%j.out"), export, "--gres=gpu:1",
                                  script=text)[0] for _ in range(2)]

    def turns() -> list[tuple[float, float, int]]:
        return completed_turns({j: (out / f"{j}.log").read_text().splitlines() if (out / f"{j}.log").exists() else []
                                for j in jobs})

    def lanes() -> list[dict[str, Any]]:
        return [lane for lane in call(cluster.agent_socket, {"op": "status"})["lanes"]["lanes"] if lane["jobs"]]
    try:
        cluster.wait_for(lambda: all(sum(1 for t in turns() if t[2] == j) >= 3 for j in jobs), 90,
                         "the lane jobs did not take turns")
        assert [sorted(lane["jobs"]) for lane in lanes()] == [sorted(str(j) for j in jobs)]  # one lane, both
        cluster.stop_agent(signal.SIGKILL)
        cluster.start_agent()
        restarted_at = time.time()
        cluster.wait_for(lambda: [sorted(lane["jobs"]) for lane in lanes()] == [sorted(str(j) for j in jobs)], 30,
                         "the lane jobs did not join their lane on the restarted agent")
        print(f"lanes rejoined {time.time() - restarted_at:.1f} s after the agent's restart")
        for job in jobs:
            assert cluster.wait_job(job, 120).state == "COMPLETED", (out / f"job-{job}.out").read_text()
        for job in jobs:
            errors = (out / f"job-{job}.out").read_text()
            assert "joined the lane again" in errors and "off for this run" not in errors, errors
            assert "GPU out of memory" not in errors, errors
        order = turns()
        assert len(order) == 60  # every step once
        later = [t for t in order if t[0] > restarted_at + 1.0]
        assert len(later) > 10
        for (_, end, _), (start, _, _) in zip(later, later[1:]):
            assert end <= start, "two jobs of one lane ran an iteration at the same time after the restart"
        ledger = RecordLedger(cluster.agent_cfg().records_dir)
        cluster.wait_for(lambda: all(ledger.get(str(j)) for j in jobs), 30, "no records")
        for job in jobs:
            records = ledger.get(str(job))
            assert len(records) == 1, records  # one run, one record
            for numbers in records[0]["gpus"].values():  # the workers train on the CPU: no share unless measured
                share = numbers.get("share_j")
                assert share is None or share <= numbers["energy_j"] * 1.001, (job, numbers)  # never twice
        assert lanes() == []  # nothing left on the lanes once both ended
    finally:
        shutil.rmtree(out, ignore_errors=True)
