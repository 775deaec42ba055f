"""On a real local Slurm with a simulated A100: pending jobs reshape 7g.40gb into 3g+2g+1g+1g.

Slurm learns the new layout by ``scontrol reconfigure`` on 24.11+ and by restarting slurmctld then slurmd on
22.05 (gpushare.mig_manager.slurm_actions); the test checks which path each release took.

The GPU is simulated (gpushare.gres.sim_backend state file); Slurm, its daemons, gres.conf with MultipleFiles of
character devices (``nvidia0`` 195:0 and ``nvidia-caps/nvidia-cap<M>`` 234:M) and the jobs are real. A
hidden ``State=FUTURE`` node declares every profile type, so sbatch accepts a ``gpu:3g.20gb`` request
while no real node has one yet (docs/mig.md, "Slurm setup").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpushare.config import parse_config
from gpushare.gres.gres_conf import gres_conf_lines, node_gpus
from gpushare.gres.sim_backend import SimBackend
from gpushare.mig_manager.device_ops import create_instance
from gpushare.mig_manager.gres_files import ensure_cap_devices
from gpushare.mig_manager.journal import JournalStore, Op
from gpushare.mig_manager.reshape import build_executor, reshape_for_demand
from gpushare.mig_manager.slurm_actions import SlurmNodeActions, gpu_counts
from devcluster.local_cluster import LocalCluster
from devcluster.processes import scaled

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
STANDBY = "gpu:1g.5gb:7,gpu:2g.10gb:3,gpu:3g.20gb:2,gpu:4g.20gb:1,gpu:7g.40gb:1"
WANTED = ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]


class MigNodeCluster(LocalCluster):
    """One node, one simulated A100-40GB in MIG mode, GRES generated from the simulated state."""

    state_path: Path = Path()

    def write_files(self) -> None:
        super().write_files()
        devices = self.device_dir("n1")
        gpus = node_gpus(SimBackend.open(self.state_path))
        ensure_cap_devices(devices, [m for g in gpus for s in g.mig or () for m in (s.gi_cap_minor, s.ci_cap_minor)],
                           234)
        # the site's files include gpushare's own, which hold n1's lines: the executor writes only those
        etc = self.base / "etc"
        (etc / "gpushare-mig-gres.conf").write_text(
            "\n".join(gres_conf_lines(gpus, str(devices), node_name="n1")) + "\n")
        (etc / "gres.conf").write_text(f"# the site's gres.conf\nInclude {etc / 'gpushare-mig-gres.conf'}\n")
        text = self.conf.read_text().replace("GresTypes=gpu,shard", "GresTypes=gpu")
        node_line = re.search(r"^NodeName=n1 .*$", text, re.M)
        assert node_line is not None
        (etc / "gpushare-mig.conf").write_text(re.sub(r" Gres=\S+", " Gres=gpu:7g.40gb:1", node_line.group(0)) + "\n")
        text = text.replace(node_line.group(0), f"Include {etc / 'gpushare-mig.conf'}")
        text = text.replace("PartitionName=gpu Nodes=n1 ", "PartitionName=gpu Nodes=n1,mig-standby ")
        text += (f"NodeName=mig-standby NodeHostname=localhost NodeAddr=127.0.0.1 Port={self.ports['n1'] + 1} "
                 f"CPUs=2 RealMemory=4000 Gres={STANDBY} State=FUTURE\n")
        self.conf.write_text(text)


def start_mig_cluster(prefix: str, cls: type[MigNodeCluster] = MigNodeCluster
                      ) -> tuple[Path, Path, SimBackend, MigNodeCluster]:
    """(folder, GPU state, simulated backend, started cluster) of one node whose simulated A100-40GB in MIG mode
    holds one 7g.40gb, the layout a freshly partitioned node has; the test is skipped without real Slurm."""
    from devcluster.local_cluster import missing_requirements

    if missing_requirements():
        pytest.skip(f"real Slurm unavailable: {missing_requirements()}")
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(base, 0o755)
    state = base / "gpus.json"
    SimBackend.from_scenario({"version": 1, "name": "mig-node", "gpus": [{"model": "a100-40gb", "mig_mode": True}]},
                             state)
    sim = SimBackend.open(state)
    create_instance(sim, Op("create", 0, "7g.40gb", 0))
    cluster = cls(base, gpus_per_node=1, with_hook=False, with_submitd=False, bin_dir=os.path.dirname(sys.executable))
    cluster.state_path = state
    cluster.start()
    return base, state, sim, cluster


@pytest.mark.version_sensitive("scontrol reconfigure applies a GRES count change from 24.11 on; 22.05 needs slurmctld and slurmd restarted")
def test_pending_mig_jobs_reshape_the_node_and_run_on_their_profiles(tmp_path: Path) -> None:
    base, state, sim, cluster = start_mig_cluster("gpushare-slurm-mig-")
    try:
        client = cluster.client
        gres_now = lambda: SlurmNodeActions(client, cluster.conf, base / "etc" / "gres.conf",  # noqa: E731
                                            lambda n: None).status("n1").gres
        assert gpu_counts(gres_now()) == {"7g.40gb": 1}
        # a job on the 7g.40gb: while it runs, demand plans nothing (never touch a busy instance)
        blocker, _ = client.sbatch("--gres=gpu:7g.40gb:1", "-o", str(base / "blocker.out"), "--wrap", "sleep 3")
        deadline = time.monotonic() + scaled(20)
        while client.require_job(blocker).state != "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.2)
        jobs = {}
        # the two 1g.5gb jobs wait for each other, so they hold their instances at the same time and must get
        # different ones; without that, one may start after the other ended and reuse its instance (the node
        # runs one job per core of this machine, and the scheduler may start them in separate passes)
        running = base / "running-1g"
        running.mkdir()
        os.chmod(running, 0o777)
        for n, profile in enumerate(WANTED):
            wait = (f"touch {running}/$SLURM_JOB_ID; for i in $(seq 150); do "
                    f"[ $(ls {running} | wc -l) -ge 2 ] && break; sleep 0.2; done" if profile == "1g.5gb" else "true")
            job_id, _ = client.sbatch(f"--gres=gpu:{profile}:1", "-o", str(base / f"job{n}.out"), "--wrap",
                                      f"echo CVD=$CUDA_VISIBLE_DEVICES; {wait}")
            jobs[job_id] = (profile, base / f"job{n}.out")
        time.sleep(1.5)
        states = {j.job_id: j.state for j in client.jobs()}
        assert states.pop(str(blocker)) == "RUNNING" and set(states.values()) == {"PENDING"}

        settings = {"agent": {"device_backend": f"sim:{state}"}, "mig": {
            "journal_dir": str(base / "journal"), "slurm_conf": str(cluster.conf),
            "gres_conf": str(base / "etc" / "gres.conf"), "device_dir": str(cluster.device_dir("n1")),
            "cap_device_major": 234, "poll_s": 0.2, "verify_timeout_s": 30, "wait_timeout_s": 30,
            "demand_min_age_s": 0}}  # the jobs were just submitted; the age bound is tested in test_demand.py
        cfg = parse_config(settings)
        busy, _ = reshape_for_demand(cfg, build_executor(cfg, "n1", restart=cluster.restart_slurm, client=client), client)
        assert busy.outcome == "nothing" and "busy 7g.40gb@0" in busy.detail, busy
        assert "DRAIN" not in client.node_states()["n1"].upper()
        assert cluster.wait_job(blocker, timeout_s=30).state == "COMPLETED"

        # [policy] mode = observe: the reshape is proposed and recorded; no GPU, file, drain or daemon changes
        etc = base / "etc"
        site = {p: p.read_bytes() for p in (cluster.conf, etc / "gres.conf")}
        own = {p: p.read_bytes() for p in (etc / "gpushare-mig.conf", etc / "gpushare-mig-gres.conf")}

        def no_restart(node: str) -> None:
            raise AssertionError(f"observe restarted Slurm for {node}")
        observe_cfg = parse_config({**settings, "policy": {"mode": "observe"}})
        started = time.monotonic()
        proposed, _ = reshape_for_demand(observe_cfg, build_executor(observe_cfg, "n1", restart=no_restart,
                                                                     client=client), client)
        observe_s = time.monotonic() - started
        assert proposed.outcome == "proposed", proposed
        proposal = json.loads((base / "journal" / "n1.proposal.json").read_text())
        assert proposal["before"] == {"0": "7g.40gb@0"} and sorted(
            item.split("@")[0] for item in proposal["target"]["0"].split(",")) == sorted(WANTED), proposal
        assert proposal["would_write"] == ["gpushare-mig.conf", "gpushare-mig-gres.conf"], proposal
        assert [gi.profile_name for gi in sim.gpu_instances(0)] == ["7g.40gb"]
        assert {p: p.read_bytes() for p in site} == site and {p: p.read_bytes() for p in own} == own
        assert "DRAIN" not in client.node_states()["n1"].upper() and gpu_counts(gres_now()) == {"7g.40gb": 1}
        assert not JournalStore(base / "journal").load("n1").history
        assert {j.state for j in client.jobs() if str(j.job_id) in {str(k) for k in jobs}} == {"PENDING"}
        print(f"\nobserve proposed the reshape in {observe_s:.2f} s")
        # a CPU job runs on the node through the reshape: neither the restarts (22.05) nor the reconfigure
        # (24.11+) may end it
        cpu_job, _ = client.sbatch("-o", str(base / "cpu.out"), "--wrap", "echo start; sleep 6; echo done")
        deadline = time.monotonic() + scaled(20)
        while client.require_job(cpu_job).state != "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.2)

        def crash(label: str) -> None:  # killed once the GPU changed but before Slurm knew
            if label == "applied":
                raise KeyboardInterrupt(label)
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            reshape_for_demand(cfg, build_executor(cfg, "n1", restart=cluster.restart_slurm, hook=crash, client=client),
                               client)
        assert "DRAIN" in client.node_states()["n1"].upper() and gpu_counts(gres_now()) == {"7g.40gb": 1}
        executor = build_executor(cfg, "n1", restart=cluster.restart_slurm, client=client)
        result, notes = executor.reconcile(), []
        reshape_s = time.monotonic() - started
        journal = JournalStore(base / "journal").load("n1")
        assert result.outcome == "applied", (result, notes, journal.log)
        assert sorted(gi.profile_name for gi in sim.gpu_instances(0)) == sorted(WANTED)
        assert gpu_counts(gres_now()) == {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2}, gres_now()
        assert "DRAIN" not in client.node_states()["n1"].upper()
        assert reshape_s < 30
        assert {p: p.read_bytes() for p in site} == site  # the site's slurm.conf and gres.conf: not a byte changed
        assert {p: p.read_bytes() for p in own} != own
        # how Slurm learned the layout: 24.11+ by `scontrol reconfigure` alone, 22.05 by both restarts
        reconfigured = any("scontrol reconfigure" in line for line in journal.log)
        restarted = any("restarting Slurm daemons" in line for line in journal.log)
        assert (reconfigured, restarted) == ((True, False) if client.version.reconfigure_applies_gres else
                                             (False, True)), journal.log
        print(f"\nreshape took {reshape_s:.2f} s:", *journal.log, sep="\n  ")  # shown with pytest -s

        # each job got the device Slurm lists for its profile: CUDA_VISIBLE_DEVICES=k is the k-th MIG
        # line of n1 in gres.conf; its cap minor names the simulated MIG device, which has that profile.
        lines = [line for line in (etc / "gpushare-mig-gres.conf").read_text().splitlines()
                 if line.startswith("NodeName=n1 ")]
        assert [line.split("Type=")[1].split()[0] for line in lines] == ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]
        by_cap = {d.gi_cap_minor: d for d in sim.mig_devices(0)}
        seen = set()
        for job_id, (profile, out) in jobs.items():
            record = cluster.wait_job(job_id, timeout_s=60)
            assert record.state == "COMPLETED", record
            index = int(re.search(r"CVD=(\d+)", out.read_text()).group(1))
            line = lines[index]
            assert f"Type={profile} " in line, (profile, line)
            cap = int(re.search(r"nvidia-cap(\d+)", line).group(1))
            assert by_cap[cap].profile_name == profile
            seen.add(index)
        assert seen == {0, 1, 2, 3}  # four jobs, four distinct instances (the 1g.5gb pair ran together)
        cpu_record = cluster.wait_job(cpu_job, timeout_s=30)
        assert (cpu_record.state, (base / "cpu.out").read_text()) == ("COMPLETED", "start\ndone\n"), cpu_record

        # assert-then-apply through the CLI: nothing pending, nothing to do, no restart (it would fail)
        toml = base / "etc" / "mig.toml"
        toml.write_text(f'version = 1\n[agent]\ndevice_backend = "sim:{state}"\n[mig]\n'
                        f'journal_dir = "{base / "journal"}"\nslurm_conf = "{cluster.conf}"\n'
                        f'device_dir = "{cluster.device_dir("n1")}"\nrestart_commands = ["/bin/false"]\n')
        gpushare = os.path.join(os.path.dirname(sys.executable), "gpushare")
        for args in (["apply", "--from-demand"], ["reconcile"]):
            proc = subprocess.run([gpushare, "mig", *args, "--node", "n1", "--config", str(toml), "--json"],
                                  capture_output=True, text=True, env=cluster.env, timeout=60)
            assert proc.returncode == 0, proc.stderr
            assert json.loads(proc.stdout)["outcome"] == "nothing", proc.stdout
        assert len(JournalStore(base / "journal").load("n1").history) == 1
    finally:
        cluster.stop()
    import shutil

    shutil.rmtree(base, ignore_errors=True)
