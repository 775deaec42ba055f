"""A GPU node lost in the middle of a MIG reshape (docs/reliability.md).

The executor has destroyed the old instance and created none of the new ones when the node is lost: the
executor dies, slurmd is killed, the node is set DOWN, slurmd comes back and the node is resumed (by hand or
by ReturnToService), still offering its old layout. ``gpushare mig reconcile`` (what the node runs when it
is back) must reach exactly one outcome from the journal: the reshape finished once, on a node drained
again for the rest of it, Slurm offering the GPU's actual layout, the node resumed and the pending jobs run;
a later pass finds nothing to do.

Same simulated A100 and real daemons as test_mig_slurm.py (one cluster, started by the test).
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from gpushare.config import parse_config
from gpushare.gres.gres_conf import node_gpus
from gpushare.mig_manager.journal import JournalStore
from gpushare.mig_manager.reshape import build_executor, reshape_for_demand
from gpushare.mig_manager.slurm_actions import SlurmNodeActions, gpu_counts
from gpushare.slurm.client import SlurmError
from test_mig_slurm import WANTED, start_mig_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.faults]


class NodeLost(Exception):
    """Raised from the executor's step hook: the run ends there, as it would with its node."""


def test_a_node_lost_mid_reshape_is_finished_once_on_a_drained_node() -> None:
    base, state, sim, cluster = start_mig_cluster("gpushare-slurm-mignode-")
    try:
        client = cluster.client
        cfg = parse_config({"agent": {"device_backend": f"sim:{state}"}, "mig": {
            "journal_dir": str(base / "journal"), "slurm_conf": str(cluster.conf),
            "gres_conf": str(base / "etc" / "gres.conf"), "device_dir": str(cluster.device_dir("n1")),
            "cap_device_major": 234, "poll_s": 0.2, "verify_timeout_s": 30, "wait_timeout_s": 30,
            "demand_min_age_s": 0}})
        jobs = [client.sbatch(f"--gres=gpu:{profile}:1", "-o", "/dev/null", "--wrap", "true")[0] for profile in WANTED]
        time.sleep(1.0)

        def lose(label: str) -> None:
            if label == "op0":  # the old instance destroyed, no new one created yet
                raise NodeLost(label)
        with pytest.raises(NodeLost):
            reshape_for_demand(cfg, build_executor(cfg, "n1", restart=cluster.restart_slurm, hook=lose, client=client),
                               client)
        store = JournalStore(base / "journal")
        interrupted = store.load("n1")
        assert interrupted.phase == "running" and [gi.profile_name for gi in sim.gpu_instances(0)] == []
        assert "DRAIN" in client.node_states()["n1"].upper()

        started = time.monotonic()
        slurmd = cluster.pids.pop("slurmd-n1")
        os.killpg(slurmd, signal.SIGKILL)
        os.waitpid(slurmd, 0)
        client.run("scontrol", "update", "nodename=n1", "state=down", "reason=lost in a fault test")
        cluster._spawn("slurmd-n1", ["slurmd", "-D", "-N", "n1", "-f", str(cluster.conf)])
        cluster._wait(lambda: "NOT_RESPONDING" not in SlurmNodeActions(client, cluster.conf, base / "etc" / "gres.conf",
                                                                       lambda n: None).status("n1").flags,
                      30, "slurmd did not register again")
        try:
            client.run("scontrol", "update", "nodename=n1", "state=resume")
        except SlurmError:  # its registration returned it first (ReturnToService)
            pass
        back = client.node_states()["n1"].upper()
        assert "DRAIN" not in back and "DOWN" not in back, back  # back in service, on its old layout

        seen: dict[str, str] = {}

        def watch(label: str) -> None:
            if label in ("op1", "gres_written"):
                seen[label] = client.node_states()["n1"].upper()
        result = build_executor(cfg, "n1", restart=cluster.restart_slurm, hook=watch, client=client).reconcile()
        print(f"\nMIG reshape after the node's loss: {result.outcome} {time.monotonic() - started:.1f} s after the loss")
        journal = store.load("n1")
        assert result.outcome == "applied", (result, journal.log)
        assert "DRAIN" in seen["op1"] and "DRAIN" in seen["gres_written"], seen  # no job starts mid-reshape
        assert (journal.phase, journal.run_id, len(journal.history)) == ("done", interrupted.run_id, 1)
        assert sorted(gi.profile_name for gi in sim.gpu_instances(0)) == sorted(WANTED)  # each op once
        status = SlurmNodeActions(client, cluster.conf, base / "etc" / "gres.conf", lambda n: None).status("n1")
        assert gpu_counts(status.gres) == {"3g.20gb": 1, "2g.10gb": 1, "1g.5gb": 2}
        assert not status.drained and "DOWN" not in status.flags, status
        caps = {p.name for p in (cluster.device_dir("n1") / "nvidia-caps").iterdir()}
        wanted = {f"nvidia-cap{m}" for g in node_gpus(sim) for s in g.mig or () for m in (s.gi_cap_minor, s.ci_cap_minor)}
        assert wanted <= caps, (wanted, caps)  # every instance's devices, for the GRES Slurm hands out
        for job_id in jobs:
            assert cluster.wait_job(job_id, timeout_s=60).state == "COMPLETED"
        again = build_executor(cfg, "n1", restart=cluster.restart_slurm, client=client).reconcile()
        assert again.outcome == "nothing", again
        follow, _ = reshape_for_demand(cfg, build_executor(cfg, "n1", restart=cluster.restart_slurm, client=client),
                                       client)
        assert follow.outcome in ("nothing", "already"), follow
        assert len(store.load("n1").history) == 1  # one reshape, not two
    finally:
        cluster.stop()
    shutil.rmtree(base, ignore_errors=True)
