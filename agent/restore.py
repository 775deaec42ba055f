"""After a restart: which of the jobs restored from the store Slurm says no longer run on this node.

Why: the agent reloads every open entry of its job store (``Agent.load``), and only a job's Epilog closes
one. A job that ended while the agent was down and whose Epilog never ran here (the node was lost with it:
slurmd and the agent stopped, the node set DOWN, the job failed with NODE_FAIL or was requeued elsewhere)
would stay open for good: tracked, its cap counted on its GPU (the lanes' memory, the withholding) and its
caps file left in the run directory for the next job with that id. So each restored job is looked up in
Slurm once, off the sampling lock; a run Slurm says is not running here is closed as lost. A job that is
still completing is left to its Epilog.
"""

from __future__ import annotations

from typing import Any

from gpushare.slurm.hostlist import expand_hostlist

# Slurm's states in which the run may still have processes on this node (or its Epilog still to come).
_HERE_STATES = frozenset({"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING",
                          "RESIZING", "STAGE_OUT"})


def not_here(slurm_job: Any, node: str, restarts: int) -> str | None:
    """Why run ``restarts`` of the job no longer runs on ``node`` (a reason to log), or None when it may."""
    if slurm_job is None:
        return "Slurm no longer knows the job"
    if slurm_job.restarts != restarts:
        return f"Slurm has run it again since (restart {slurm_job.restarts})"
    if slurm_job.completing:
        return None  # its Epilog is on its way
    if slurm_job.state not in _HERE_STATES:
        return f"it ended {slurm_job.state} while the agent was down"
    try:
        nodes = expand_hostlist(slurm_job.nodes or slurm_job.batch_host, limit=100_000, strict=True)
    except ValueError:
        return None  # unreadable: keep tracking rather than guess
    if node not in nodes:
        return f"it runs on {slurm_job.nodes or '?'}, not here"
    return None
