"""Controller coordination on a real local Slurm: the controller decides and writes the files, the node follows.

Same simulated A100 and real daemons as test_mig_slurm.py, but with ``[mig] coordination = "controller"``:
the node side is given a gres.conf path that does not exist (as on a configless node, which has no
Slurm files of its own) and must never write slurm.conf or gres.conf; the controller side
(``controller_pass``) alone decides the target from the pending jobs, writes the files the node
published through its Slurm record, and makes Slurm read them — ``scontrol reconfigure`` on 24.11+, a
slurmctld restart on 22.05, where the node then restarts only its own slurmd. Everything between the two
goes through ``scontrol update nodename=n1 extra=|comment=``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
from devcluster.processes import scaled

from gpushare.config import parse_config
from gpushare.mig_manager.coordination import controller_pass
from gpushare.mig_manager.journal import JournalStore
from gpushare.mig_manager.node_record import parse_report, parse_target, read_records
from gpushare.mig_manager.reshape import build_executor, reshape_for_demand
from gpushare.mig_manager.slurm_actions import gpu_counts
from test_mig_slurm import WANTED, MigNodeCluster, start_mig_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


class SplitCluster(MigNodeCluster):
    """The daemons restarted one at a time, each by its own side (a site restarts each on its own host)."""

    def restart_controller(self) -> None:
        self.stop_process("slurmctld")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])

    def restart_node(self, node: str) -> None:
        self.stop_process(f"slurmd-{node}")
        self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])


@pytest.mark.version_sensitive("scontrol reconfigure applies a GRES count change from 24.11 on; 22.05 needs slurmctld and slurmd restarted")
def test_controller_decides_and_writes_the_files_while_the_node_only_changes_its_gpus() -> None:
    base, state, sim, cluster = start_mig_cluster("gpushare-slurm-migctl-", SplitCluster)
    try:
        client = cluster.client
        gres_conf = base / "etc" / "gres.conf"
        nowhere = base / "node-has-no-slurm-files"
        common = {"coordination": "controller", "poll_s": 0.2, "verify_timeout_s": 30, "wait_timeout_s": 30,
                  "demand_min_age_s": 0}  # the jobs were just submitted; the age bound is tested in test_demand.py
        # node side: its own journal, devices and backend; a gres.conf path that does not exist
        node_cfg = parse_config({"agent": {"device_backend": f"sim:{state}"}, "slurm": {"conf": str(cluster.conf)},
                                 "mig": {**common, "journal_dir": str(base / "node-journal"),
                                         "gres_conf": str(nowhere / "gres.conf"),
                                         "device_dir": str(cluster.device_dir("n1")), "cap_device_major": 234}})
        # controller side: the files, no GPU
        ctl_cfg = parse_config({"slurm": {"conf": str(cluster.conf)},
                                "mig": {**common, "journal_dir": str(base / "controller"),
                                        "gres_conf": str(gres_conf)}})

        def follow() -> object:
            executor = build_executor(node_cfg, "n1", restart=cluster.restart_node, client=client)
            return reshape_for_demand(node_cfg, executor, client)

        def control() -> list[str]:
            return controller_pass(ctl_cfg, client, cluster.conf, gres_conf, cluster.restart_controller)

        def record() -> tuple:
            rec = read_records(client, "n1")[0]
            return parse_report(rec.comment, "n1"), parse_target(rec.extra, "n1")

        running = base / "running-1g"
        running.mkdir()
        os.chmod(running, 0o777)
        jobs = {}
        for n, profile in enumerate(WANTED):  # the 1g.5gb pair waits for each other: two distinct instances
            wait = (f"touch {running}/$SLURM_JOB_ID; for i in $(seq 150); do "
                    f"[ $(ls {running} | wc -l) -ge 2 ] && break; sleep 0.2; done" if profile == "1g.5gb" else "true")
            job_id, _ = client.sbatch(f"--gres=gpu:{profile}:1", "-o", str(base / f"job{n}.out"), "--wrap",
                                      f"echo CVD=$CUDA_VISIBLE_DEVICES; {wait}")
            jobs[job_id] = (profile, base / f"job{n}.out")

        # the node has not reported yet: the controller plans nothing; the node's first run reports its layout
        assert not any("target" in note for note in control())
        first, _ = follow()
        assert first.outcome == "nothing", first
        report, target = record()
        assert (report.state, report.gpus, target) == ("idle", {0: ("a100-40gb", "7g.40gb@0")}, None)

        started = time.monotonic()
        notes = control()  # the one place that decides: a target for n1 serving all four jobs
        report, target = record()
        assert target is not None and sorted(i.split("@")[0] for i in target.layouts[0].split(",")) == sorted(
            WANTED), notes
        before = (cluster.conf.read_text(), gres_conf.read_text())

        outcome: dict[str, object] = {}
        def node_run() -> None:
            try:
                outcome["result"] = follow()
            except BaseException as exc:  # noqa: BLE001 - shown by the assertions below
                outcome["error"] = exc
        worker = threading.Thread(target=node_run, daemon=True)
        worker.start()
        deadline = time.monotonic() + scaled(30)
        while (record()[0].state != "files") and time.monotonic() < deadline and worker.is_alive():
            time.sleep(0.2)
        report, _ = record()
        assert report.state == "files" and report.run == target.run, (report, outcome)
        # the node changed its GPU and published, but wrote no Slurm file
        assert (cluster.conf.read_text(), gres_conf.read_text()) == before and not nowhere.exists()
        assert sorted(gi.profile_name for gi in sim.gpu_instances(0)) == sorted(WANTED)
        assert "DRAIN" in client.node_states()["n1"].upper()
        notes = control()
        worker.join(timeout=40)
        reshape_s = time.monotonic() - started
        assert not worker.is_alive()
        assert "error" not in outcome, outcome
        result, _ = outcome["result"]  # type: ignore[misc]
        journal = JournalStore(base / "node-journal").load("n1")
        assert result.outcome == "applied", (result, notes, journal.log)
        assert journal.run_id == target.run
        assert any("wrote Gres=" in note for note in notes), notes
        reloaded = "scontrol reconfigure" in notes if client.version.reconfigure_applies_gres else any(
            "restarted slurmctld" in note for note in notes)
        assert reloaded, notes
        # 22.05: the node restarted its own slurmd after the controller's slurmctld restart; 24.11+: neither
        node_restarted = any("restarting Slurm daemons" in line for line in journal.log)
        assert node_restarted == (not client.version.reconfigure_applies_gres), journal.log
        status = read_records(client, "n1")[0]
        assert gpu_counts(status.gres) == {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2}, status
        assert "DRAIN" not in client.node_states()["n1"].upper()
        report, target = record()
        assert (report.state, report.run, target.run) == ("done", target.run, report.run) and target.written != "-"
        assert not nowhere.exists()
        print(f"\ncontroller-coordinated reshape took {reshape_s:.2f} s:", *notes, *journal.log, sep="\n  ")

        # the controller wrote only gpushare's include files; the site's slurm.conf and gres.conf are as before
        assert (cluster.conf.read_text(), gres_conf.read_text()) == before
        lines = [line for line in (base / "etc" / "gpushare-mig-gres.conf").read_text().splitlines()
                 if line.startswith("NodeName=n1 ")]
        assert [line.split("Type=")[1].split()[0] for line in lines] == ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]
        by_cap = {d.gi_cap_minor: d for d in sim.mig_devices(0)}
        seen = set()
        for job_id, (profile, out) in jobs.items():
            job = cluster.wait_job(job_id, timeout_s=60)
            assert job.state == "COMPLETED", job
            index = int(re.search(r"CVD=(\d+)", out.read_text()).group(1))
            assert f"Type={profile} " in lines[index], (profile, lines[index])
            assert by_cap[int(re.search(r"nvidia-cap(\d+)", lines[index]).group(1))].profile_name == profile
            seen.add(index)
        assert seen == {0, 1, 2, 3}

        # nothing pending any more, through the commands each host's timer runs: no new target, and the
        # node has nothing to do (the node's restart command would fail if it ran)
        slurm = f'[slurm]\nconf = "{cluster.conf}"\n' + (f'bin_dir = "{cluster.slurm_bin_dir}"\n'
                                                          if cluster.slurm_bin_dir else "")
        ctl_toml, node_toml = base / "etc" / "controller.toml", base / "etc" / "node.toml"
        ctl_toml.write_text(f'version = 1\n{slurm}[mig]\ncoordination = "controller"\n'
                            f'journal_dir = "{base / "controller"}"\ngres_conf = "{gres_conf}"\n'
                            'controller_restart_commands = ["/bin/false"]\n')
        node_toml.write_text(f'version = 1\n[agent]\ndevice_backend = "sim:{state}"\n{slurm}[mig]\n'
                             f'coordination = "controller"\njournal_dir = "{base / "node-journal"}"\n'
                             f'device_dir = "{cluster.device_dir("n1")}"\nnode_restart_commands = ["/bin/false"]\n')
        gpushare = os.path.join(os.path.dirname(sys.executable), "gpushare")
        for args in (["controller", "--config", str(ctl_toml)],
                     ["apply", "--from-demand", "--node", "n1", "--config", str(node_toml)]):
            proc = subprocess.run([gpushare, "mig", *args, "--json"], capture_output=True, text=True,
                                  env=cluster.env, timeout=60)
            assert proc.returncode == 0, proc.stderr
            out = json.loads(proc.stdout)
            assert out.get("outcome", "nothing") == "nothing" and not any("target" in n for n in out.get("notes", [])), out
        assert len(JournalStore(base / "node-journal").load("n1").history) == 1
    finally:
        cluster.stop()
    shutil.rmtree(base, ignore_errors=True)
