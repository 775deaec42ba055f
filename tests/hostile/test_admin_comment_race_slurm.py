"""AdminComment writers interleaved on a real Slurm: no writer's keys are lost (gpushare/slurm/admin_comment.py).

Three processes write one running job's record at once, through the code paths the product uses: the node
agent (a collateral note, then its run summary, both from a job snapshot read before either write, as the
agent once did and lost the note), the node Epilog (its final run summary) and the controller's estimation
service (``est_job``). Every key each wrote must be in the record at the end.
"""

from __future__ import annotations

import multiprocessing
import subprocess

import pytest

from gpushare.node.comment import annotate, annotate_fields
from gpushare.slurm import record
from gpushare.slurm.admin_comment import merge_fields, merge_write
from gpushare.slurm.client import SlurmClient

pytestmark = [pytest.mark.slurm, pytest.mark.hostile]
ROUNDS = 4


def _agent(client: SlurmClient, job: str) -> None:
    for i in range(ROUNDS):
        snapshot = client.job(job)  # read once, then two writes: the second once dropped the first's note
        annotate_fields(client, job, snapshot, collateral={"by": 100 + i, "gib": 2.0})
        annotate(client, job, {"node": "n1", "ttfk_s": float(i)}, snapshot)


def _epilog(client: SlurmClient, job: str) -> None:
    for i in range(ROUNDS):
        annotate(client, job, {"node": "n1", "exit_code": i})


def _controller(client: SlurmClient, job: str) -> None:
    for i in range(ROUNDS):
        merge_write(client, job, merge_fields(est_job=1000 + i))


def test_agent_epilog_and_controller_writes_interleave_without_loss(slurm_cluster):
    client = slurm_cluster.client
    job_id, _ = client.sbatch("-o", "/dev/null", "--wrap=sleep 120")
    try:
        client.update_job(job_id, admincomment=record.render({"decision": "shared"}) or "")
        ctx = multiprocessing.get_context("fork")
        writers = [ctx.Process(target=w, args=(client, str(job_id)))
                   for w in (_agent, _epilog, _controller)]
        for w in writers:
            w.start()
        for w in writers:
            w.join(120)
            assert w.exitcode == 0
        final = record.parse(client.require_job(job_id).admin_comment)
        assert final is not None, client.require_job(job_id).admin_comment
        assert final["decision"] == "shared" and final["est_job"] == 1000 + ROUNDS - 1, final
        assert final["collateral"] == {"by": 100 + ROUNDS - 1, "gib": 2.0}, final
        assert final["run"]["ttfk_s"] == ROUNDS - 1 and final["run"]["exit"] == ROUNDS - 1, final
    finally:
        subprocess.run(["scancel", str(job_id)], env=slurm_cluster.env, check=False)
