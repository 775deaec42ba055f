"""What a researcher and the suite do on a cluster whose roles are hosts of their own (devcluster/multihost.py).

Shipped defaults throughout; the site settings are in tests/multihost/conftest.py. Job logs stay on the GPU
node's own /tmp (``--output=/tmp/...``), homes are 0700 and the controller's root cannot read them.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from devcluster.local_cluster import ClusterError
from devcluster.multihost import SIM_DIR
from gpushare.slurm.gres_request import plain_gres
from gpushare.slurm.jobs import ENDED_STATES
from gpushare.slurm.record import parse as parse_record

pytestmark = [pytest.mark.slurm, pytest.mark.multihost]
SIMJOB = Path(__file__).parents[1] / "agent" / "simjob.py"  # a GPU process on the simulated backend
ALICE = "gpushare-alice"

TRAIN = """import torch
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)).cuda()
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    x = torch.randn(64, 512, device="cuda")
    loss = model(x).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""
BATCH = """#!/bin/sh
#SBATCH --gres=gpu:1
#SBATCH --output=/tmp/job-%j.out
echo "on $(hostname): CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES shards=${SLURM_SHARDS_ON_NODE:-none}"
"""


@pytest.mark.torch
def test_an_estimate_made_on_the_login_host_travels_in_the_script_and_shares_the_gpu(multihost):
    cluster = multihost()
    cluster.write_as(ALICE, "train.py", TRAIN)
    cluster.write_as(ALICE, "train.sbatch", BATCH)
    done = cluster.run("login", ["gpu-estimate", "--gpu", "a100-40gb", "--annotate", "train.py", "--", "train.sbatch"],
                       user=ALICE, cwd=f"/home/{ALICE}", timeout_s=300)
    job_id = int(re.findall(r"Submitted batch job (\d+)", done.stdout + done.stderr)[-1])
    job = cluster.wait_job(job_id, 60)
    record = parse_record(job.admin_comment) or {}
    assert job.state == "COMPLETED" and plain_gres(job.tres_per_node).startswith("shard:"), (job, record)
    assert record.get("decision") == "shared" and record.get("src") == "directive:est", record
    output = cluster.path_on("gpu1", f"/tmp/job-{job_id}.out").read_text()  # the node's own disk
    assert output.startswith("on gpu1: ") and "shards=none" not in output, output
    assert not cluster.path_on("login", f"/tmp/job-{job_id}.out").exists()


def test_an_estimate_file_the_controller_cannot_read_is_refused_with_the_way_out(multihost):
    """``#GPUSHARE estimate=PATH`` in a 0700 home: root on the controller cannot open it (root squash)."""
    cluster = multihost()
    cluster.write_as(ALICE, "estimate.json", '{"schema_version": 1, "peak_bytes": 4294967296}')
    cluster.write_as(ALICE, "job.sbatch", BATCH.replace("#SBATCH --gres", "#GPUSHARE estimate=estimate.json\n#SBATCH --gres"))
    try:
        job_id = cluster.sbatch("login", ALICE, (cluster.home(ALICE) / "job.sbatch").read_text())
    except ClusterError as exc:  # a site that rejects rather than keeps the GPU whole
        assert "gpu-estimate --annotate" in str(exc)
        return
    job = cluster.wait_job(job_id, 60)
    record = parse_record(job.admin_comment) or {}
    assert job.state == "COMPLETED" and plain_gres(job.tres_per_node) == "gpu:1", (job, record)
    assert "controller can read" in str(record.get("why")) and "--annotate" in str(record.get("why")), record


@pytest.mark.torch
def test_a_job_without_an_estimate_is_estimated_on_the_cpu_node_and_shared(multihost):
    """Asynchronous estimation across hosts: the estimation job runs as the user on cpu1, its result reaches
    the controller in the job's Comment (no spool shared between cpu1 and ctl), the held job is released
    with a share."""
    cluster = multihost()
    cluster.write_as(ALICE, "train.py", TRAIN)
    python = f"{cluster.bin_dir}/python"
    job_id = cluster.sbatch("login", ALICE, BATCH + f"{python} train.py\n")
    job = cluster.wait_job(job_id, 240)
    record = parse_record(job.admin_comment) or {}
    assert record.get("decision") == "shared" and record.get("src") == "async", (job, record)
    assert plain_gres(job.tres_per_node).startswith("shard:"), job
    est = cluster.client.require_job(record["est_job"])
    assert est.state == "COMPLETED" and est.nodes == "cpu1" and est.user_name == ALICE, est
    assert est.std_out == "/dev/null"  # no shared, guessable output path: the result travels in its Comment


def _recovered(cluster, job_id: int, timeout_s: float = 150.0):  # type: ignore[no-untyped-def]
    """The job once OOM recovery decided and the re-run ended (or the first run ended with no re-run)."""
    deadline = time.monotonic() + timeout_s
    job = None
    while time.monotonic() < deadline:
        job = cluster.client.require_job(job_id)
        if job.state in ENDED_STATES and not job.completing and (job.restarts >= 1 or job.state == "FAILED"):
            time.sleep(2.0)  # a recovery decided by EpilogSlurmctld shows as a requeue within a moment
            again = cluster.client.require_job(job_id)
            if (again.states, again.restarts) == (job.states, job.restarts):
                return again
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not finished in {timeout_s:.0f} s: {job}")


@pytest.mark.version_sensitive("the OOM rerun is gpu:1 where a held job may change GRES name (24.11+), shard:40 on 22.05")
def test_a_framework_oom_is_corroborated_through_slurm_requeued_whole_and_its_lesson_kept(multihost):
    """Shipped [oom] defaults (corroboration on). The job fills 4.2 GiB of its 5 GiB share on gpu1 and ends
    with PyTorch's own OOM text in a log on gpu1's disk. The controller has neither the log nor the node's
    records: the message comes from the job's TaskEpilog on gpu1 (its Comment), the peak from the agent on gpu1
    (the AdminComment it wrote while the job ran)."""
    cluster = multihost(agents=True)
    cluster.wait_for(lambda: cluster.path_on("gpu1", "/run/gpushare/agent/agent.sock").exists(), 20, "agent")
    python = f"{cluster.bin_dir}/python"
    script = (f"#!/bin/sh\n#SBATCH --gres=gpu:1\n#SBATCH --output=/tmp/job-%j.out\n#SBATCH --open-mode=append\n"
              f"#GPUSHARE mem=4G\n{python} {SIMJOB} --mem-mib 4300 --seconds 4 --oom-first-run\n")
    job_id = cluster.sbatch("login", ALICE, script)
    after = _recovered(cluster, job_id)
    whole = "gpu:1" if cluster.client.version.held_gres_across_names else "shard:40"  # docs/compatibility.md
    log = cluster.path_on("gpu1", f"/tmp/job-{job_id}.out").read_text()
    assert (after.restarts, after.state, plain_gres(after.tres_per_node)) == (1, "COMPLETED", whole), (after, log)
    assert "CUDA out of memory" in log
    assert not list(cluster.path_on("ctl", "/var/lib/gpushare/records").glob("*"))  # nothing of gpu1's here
    again = cluster.sbatch("login", ALICE, script)  # the same script: the lesson is a floor under mem=4G
    record = parse_record(cluster.client.require_job(again).admin_comment) or {}
    assert record.get("src") == "learned" and record.get("est_gib", 0) > 4.2, record
    cluster.run("login", ["scancel", str(again)])


def test_the_check_command_names_the_node_whose_configuration_differs_or_is_missing(multihost):
    """gpu1's gpushare.toml was edited on gpu1 alone; mig1 has none (its agent runs on defaults, as
    ``--defaults`` lets it). ``gpushare doctor`` on the controller compares them with its own through the
    agents' metrics endpoints: nothing shared between the hosts."""
    cluster = multihost()
    edited = cluster.path_on("gpu1", "/etc/slurm/gpushare.toml")
    edited.write_text(edited.read_text().replace("[policy]\n", "[policy]\nmargin_fraction = 0.3\n", 1))
    cluster.path_on("mig1", "/etc/slurm/gpushare.toml").unlink()
    cluster.start_agent("gpu1")
    # on defaults its GPUs would be NVML's; the simulated driver stands in, named by environment
    cluster.start_agent("mig1", "--defaults", env={"GPUSHARE_DEVICE_BACKEND": f"sim:{SIM_DIR}/sim.json"})
    cluster.wait_for(lambda: cluster.agent_up("gpu1") and cluster.agent_up("mig1"), 20, "agents")
    time.sleep(1.0)  # the metrics endpoint starts beside the socket
    done = cluster.run("ctl", ["gpushare", "doctor", "--json"], check=False)
    report = json.loads(done.stdout)
    hosts = {h["node"]: h for h in report["hosts"]}
    assert done.returncode == 1 and not report["ok"], done.stdout
    assert hosts["gpu1"]["status"] == "differs" and hosts["gpu1"]["sha256"] != report["config"]["sha256"], hosts
    assert hosts["mig1"]["status"] == "no config", hosts
    same = cluster.path_on("ctl", "/etc/slurm/gpushare.toml").read_bytes()
    edited.write_bytes(same)  # the admin puts the controller's file back on gpu1 and restarts its agent
    cluster.stop_process("gpu1:agent")
    cluster.start_agent("gpu1")
    cluster.wait_for(lambda: json.loads(cluster.run("ctl", ["gpushare", "doctor", "--json"], check=False).stdout)
                     ["hosts"][0]["status"] == "ok", 20, "gpu1 agreeing again")


MIG_WANTED = ("3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb")


@pytest.mark.version_sensitive("MIG jobs get devices with shard in GresTypes from 24.11 (not 22.05); reconfigure applies the layout")
def test_pending_mig_jobs_reshape_the_configless_node_and_run_on_their_profiles(multihost):
    """mig1 has no slurm.conf or gres.conf of its own (configless). The controller alone decides its target
    from the pending jobs and owns the files; mig1 changes its GPU; they meet only in mig1's Slurm record
    ([mig] coordination = "controller", docs/mig.md). The two 1g.5gb jobs wait for each other on mig1's /tmp,
    so two distinct instances are proven, not lucky. One setting differs from what ships, by environment:
    ``[mig] demand_min_age_s`` (default 300 s, so that no freshly submitted job triggers a reshape) is 0 here,
    because the jobs were just submitted; the age bound itself is tested in tests/mig_exec/test_demand.py."""
    cluster = multihost()
    apply = ["gpushare", "mig", "apply", "--from-demand", "--node", "mig1", "--json"]
    controller = ["gpushare", "mig", "controller", "--json"]
    settings = {"GPUSHARE_MIG_DEMAND_MIN_AGE_S": "0", "GPUSHARE_MIG_POLL_S": "0.2"}  # see the docstring
    first = json.loads(cluster.run("mig1", apply, env=settings).stdout)  # the node reports its layout
    assert first["outcome"] == "nothing", first
    jobs = {}
    for n, profile in enumerate(MIG_WANTED):
        wait = ('touch /tmp/pair-$SLURM_JOB_ID; for i in $(seq 150); do [ $(ls /tmp | grep -c ^pair-) -ge 2 ] '
                '&& break; sleep 0.2; done' if profile == "1g.5gb" else "true")
        jobs[cluster.sbatch("login", ALICE, f"#!/bin/sh\necho CVD=$CUDA_VISIBLE_DEVICES\n{wait}\n", "-p", "mig",
                            f"--gres=gpu:{profile}:1", f"--output=/tmp/mig-{n}.out")] = (profile, n)
    stop = threading.Event()
    passes: list[dict] = []

    def control() -> None:  # the controller's timer, every second
        while not stop.is_set():
            done = cluster.run("ctl", controller, env=settings, check=False)
            if done.returncode == 0:
                passes.append(json.loads(done.stdout))
            stop.wait(1.0)

    timer = threading.Thread(target=control, daemon=True)
    timer.start()
    try:
        cluster.wait_for(lambda: any("target" in note for p in passes for note in p.get("notes", [])), 30,
                         "a target for mig1")
        applied = json.loads(cluster.run("mig1", apply, env=settings, timeout_s=120).stdout)
    finally:
        stop.set()
        timer.join(30)
    assert applied["outcome"] == "applied", (applied, passes)
    assert not cluster.path_on("mig1", "/etc/slurm/slurm.conf").exists()  # still configless
    # mig1's lines are in gpushare's own include file; the site's gres.conf only includes it
    assert "NodeName=mig1 " not in cluster.path_on("ctl", "/etc/slurm/gres.conf").read_text()
    gres = cluster.path_on("ctl", "/etc/slurm/gpushare-mig-gres.conf").read_text()
    lines = [line for line in gres.splitlines() if line.startswith("NodeName=mig1 ")]
    assert sorted(line.split("Type=")[1].split()[0] for line in lines) == sorted(MIG_WANTED), gres
    seen, blind = set(), []
    for job_id, (profile, n) in jobs.items():
        job = cluster.wait_job(job_id, 90)
        output = cluster.path_on("mig1", f"/tmp/mig-{n}.out").read_text()
        assert job.state == "COMPLETED" and job.batch_host == "mig1", (job, output)
        assert job.tres_per_node.endswith(f"gpu:{profile}:1"), job
        found = re.search(r"CVD=(\d+)", output)
        if not found:
            blind.append(profile)
            continue
        index = int(found.group(1))
        assert f"Type={profile} " in lines[index], (profile, lines[index])
        seen.add(index)
    if cluster.slurm_at_least("24.11"):
        assert seen == {0, 1, 2, 3} and not blind, (seen, blind)
    else:  # a 22.05 defect with `shard` in GresTypes (docs/mig.md, Executor limitations): jobs on the instances
        # past the node's first gres.conf lines start without CUDA_VISIBLE_DEVICES
        assert blind and len(seen) + len(blind) == 4, (seen, blind)


def test_a_jobs_gpu_story_outlives_its_node_in_the_accounting_database(multihost):
    """slurmdbd on the controller. The node's Epilog on gpu1 stores the job's record with sacctmgr; gpu1's
    local records and agent state are then wiped; ``gpushare jobstats`` on the login host reads it with sacct
    alone, for its owner only (PrivateData=jobs)."""
    cluster = multihost(agents=True, accounting=True)
    cluster.wait_for(lambda: cluster.agent_up("gpu1"), 20, "agent")
    python = f"{cluster.bin_dir}/python"
    script = (f"#!/bin/sh\n#SBATCH --gres=gpu:1\n#SBATCH --output=/tmp/job-%j.out\n#GPUSHARE mem=8G\n"
              f"{python} {SIMJOB} --mem-mib 3000 --seconds 3\n")
    job_id = cluster.sbatch("login", ALICE, script)
    job = cluster.wait_job(job_id, 90)
    assert job.state == "COMPLETED", (job, cluster.path_on("gpu1", f"/tmp/job-{job_id}.out").read_text())
    cluster.wait_for(lambda: "peak_gib" in cluster.run("login", ["sacct", "-n", "-X", "-P", "-j", str(job_id),
                                                                 "-o", "AdminComment"]).stdout, 30, "the stored record")
    for directory in ("/var/lib/gpushare/records", "/var/lib/gpushare/agent"):
        shutil.rmtree(cluster.path_on("gpu1", directory), ignore_errors=True)
    done = cluster.run("login", ["gpushare", "jobstats", "--json", str(job_id)], user=ALICE)
    stats = json.loads(done.stdout)
    assert (stats["state"], stats["decision"], stats["share_gib"]) == ("COMPLETED", "shared", 9.0), stats
    assert stats["peak_gib"] == pytest.approx(3000 / 1024, abs=0.05) and stats["user"] == ALICE
    assert stats["advice"].startswith("this job peaked at 2.93 GiB of its 9 GiB share"), stats["advice"]
    other = cluster.run("login", ["gpushare", "jobstats", str(job_id)], user="gpushare-bob", check=False)
    assert other.returncode == 1 and "not yours to read" in other.stderr, (other.stdout, other.stderr)
