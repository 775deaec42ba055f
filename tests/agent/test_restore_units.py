"""Which restored jobs the agent closes as lost after a restart (gpushare.agent.restore), from Slurm's record."""

from __future__ import annotations

from gpushare.agent.restore import not_here
from gpushare.slurm.jobs import job_from_json


def slurm_job(state: str, restarts: int = 0, nodes: str = "n[1-2]", flags: tuple[str, ...] = ()) -> object:
    return job_from_json({"job_id": 7, "job_state": [state, *flags], "restart_cnt": restarts, "nodes": nodes})


def test_a_run_still_on_this_node_or_completing_is_kept():
    assert not_here(slurm_job("RUNNING"), "n2", 0) is None
    assert not_here(slurm_job("NODE_FAIL", flags=("COMPLETING",)), "n2", 0) is None  # its Epilog may still come


def test_a_run_that_ended_moved_or_was_rerun_while_the_agent_was_down_is_lost():
    assert "NODE_FAIL" in not_here(slurm_job("NODE_FAIL"), "n2", 0)
    assert "not here" in not_here(slurm_job("RUNNING", nodes="n3"), "n2", 0)
    assert "restart 1" in not_here(slurm_job("PENDING", restarts=1), "n2", 0)
    assert "no longer knows" in not_here(None, "n2", 0)
