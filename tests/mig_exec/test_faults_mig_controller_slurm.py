"""A MIG reshape under controller coordination survives slurmctld restarts (docs/reliability.md).

The controller publishes a node's target, the node reshapes and publishes what it now has, the controller
writes the files and acknowledges: everything between them lives in the node's Slurm record (``extra`` and
``comment``; gpushare.mig_manager.node_record). Here slurmctld is restarted (as an outside restart would)
at the two points where a record is waiting for the other side: after the target is published and before
the node follows, and after the node published its layout and before the controller acknowledged. The
reshape must converge to one outcome: applied once, with one journal run, the controller's target, the
GRES Slurm offers and the jobs served; and a later pass must find nothing left to do.

Same simulated A100 and real daemons as test_mig_controller_slurm.py.
"""

from __future__ import annotations

import shutil
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
from test_mig_controller_slurm import SplitCluster
from test_mig_slurm import WANTED, start_mig_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.faults]


def test_slurmctld_restarted_twice_during_a_controller_coordinated_reshape_applies_it_once() -> None:
    base, state, sim, cluster = start_mig_cluster("gpushare-slurm-migfault-", SplitCluster)
    try:
        client = cluster.client
        gres_conf = base / "etc" / "gres.conf"
        common = {"coordination": "controller", "poll_s": 0.2, "verify_timeout_s": 30, "wait_timeout_s": 60,
                  "demand_min_age_s": 0}
        node_cfg = parse_config({"agent": {"device_backend": f"sim:{state}"}, "slurm": {"conf": str(cluster.conf)},
                                 "mig": {**common, "journal_dir": str(base / "node-journal"),
                                         "gres_conf": str(base / "node-has-no-slurm-files" / "gres.conf"),
                                         "device_dir": str(cluster.device_dir("n1")), "cap_device_major": 234}})
        ctl_cfg = parse_config({"slurm": {"conf": str(cluster.conf)},
                                "mig": {**common, "journal_dir": str(base / "controller"),
                                        "gres_conf": str(gres_conf)}})

        def follow() -> object:
            return reshape_for_demand(node_cfg, build_executor(node_cfg, "n1", restart=cluster.restart_node,
                                                               client=client), client)

        def control() -> list[str]:
            return controller_pass(ctl_cfg, client, cluster.conf, gres_conf, cluster.restart_controller)

        def record() -> tuple:
            rec = read_records(client, "n1")[0]
            return parse_report(rec.comment, "n1"), parse_target(rec.extra, "n1")

        def outside_restart() -> None:
            cluster.restart_controller()
            cluster._wait(cluster._controller_up, 60, "slurmctld did not come back")

        jobs = [client.sbatch(f"--gres=gpu:{profile}:1", "-o", "/dev/null", "--wrap", "true")[0] for profile in WANTED]
        control()
        follow()  # the node's first report
        control()  # the target
        _, target = record()
        assert target is not None
        started = time.monotonic()
        outside_restart()  # point 1: target published, node not yet following
        assert record()[1] == target  # the target survived in the node's record

        outcome: dict[str, object] = {}

        def node_run() -> None:
            try:
                outcome["result"] = follow()
            except BaseException as exc:  # noqa: BLE001 - shown by the assertions below
                outcome["error"] = exc
        worker = threading.Thread(target=node_run, daemon=True)
        worker.start()
        deadline = time.monotonic() + scaled(60)
        while record()[0].state != "files" and time.monotonic() < deadline and worker.is_alive():
            time.sleep(0.2)
        report, _ = record()
        assert report.state == "files" and report.run == target.run, (report, outcome)
        outside_restart()  # point 2: the node published its layout, the controller has not acknowledged
        assert record()[0].state == "files" and record()[0].run == target.run
        notes = control()
        worker.join(timeout=90)
        assert not worker.is_alive() and "error" not in outcome, outcome
        result, _ = outcome["result"]  # type: ignore[misc]
        journal = JournalStore(base / "node-journal").load("n1")
        assert result.outcome == "applied" and journal.run_id == target.run, (result, notes, journal.log)
        print(f"\nreshape across two slurmctld restarts: {time.monotonic() - started:.1f} s")
        assert gpu_counts(read_records(client, "n1")[0].gres) == {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2}
        assert sorted(gi.profile_name for gi in sim.gpu_instances(0)) == sorted(WANTED)  # reshaped once
        assert "DRAIN" not in client.node_states()["n1"].upper()
        for job_id in jobs:
            assert cluster.wait_job(job_id, timeout_s=60).state == "COMPLETED"
        assert not any("target" in note for note in control())  # nothing left to decide
        again, _ = follow()
        assert again.outcome == "nothing", again
        assert len(JournalStore(base / "node-journal").load("n1").history) == 1  # one reshape run, not two
    finally:
        cluster.stop()
    shutil.rmtree(base, ignore_errors=True)
