"""Jobs the agent finds running on its GPUs without a registration, adopted from Slurm's own record.

Why: slurmd runs the Prolog only on the first launch of a job id that its credential cache does not
remember. A job requeued and started again on the same node soon after (OOM recovery does exactly that)
can start without its Prolog: measured on Slurm 22.05 (docs/compatibility.md). Such a run would have no
caps, no backstop and no record. Its processes still show on the GPU, and the node knows their job (the
``job_<id>`` cgroup; ``SLURM_JOB_ID`` only where Slurm uses no cgroups), so the agent registers the job
itself with the same facts the Prolog would have sent: the grant and the estimate from Slurm's
structured record, the GPUs from where its processes are.

Nothing here trusts the process: a job is adopted only when Slurm says it is running on this node, was
granted a GPU (a CPU-only job on a node without device cgroups can open the GPU: adopted, it would run
uncapped; left unadopted, its processes belong to no job there and the backstop stops them), and
every process claiming it belongs to the job's own user (so a process that sets ``SLURM_JOB_ID`` itself
can at most adopt its own user's job). The TaskProlog has already run, so no MPS pipe or framework cap
can reach the job any more: an adopted job gets the memory-fraction mode's bookkeeping and the agent's
backstop, and its record says ``registered_by = "agent-adopted"`` with no TTFK (its start was not seen).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from gpushare.slurm.hostlist import expand_hostlist

log = logging.getLogger("gpushare.agent")
RETRY_S = 30.0  # a job Slurm did not confirm is looked up again at most this often
MAX_REMEMBERED = 4096  # bound on the retry table (a node with many short unregistered jobs)


def process_uid(pid: int, proc: str = "/proc") -> int | None:
    """The real uid of a process, from the kernel's ``/proc/<pid>/status`` (``Uid:`` real, effective, saved,
    fs); None when gone or unreadable.

    Why not the owner of ``/proc/<pid>`` or its files: proc(5) shows the files of a non-dumpable process
    (``prctl(PR_SET_DUMPABLE, 0)``, which any process may call on itself) as root's, and root's processes
    are never stopped as unattributed: that would be a way out of the backstop. The real uid is the user's
    even across a setuid program, and no unprivileged process can change it."""
    try:
        with open(f"{proc}/{int(pid)}/status", "rb") as status:
            for line in status.read(8192).splitlines():
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class Adopter:
    """Which unregistered jobs to look up in Slurm now, and whether Slurm's answer allows adopting them."""

    retry_s: float = RETRY_S
    uid_of: Callable[[int], int | None] = process_uid
    _tried: dict[str, tuple[float, frozenset[int]]] = field(default_factory=dict)
    # job -> why Slurm's record of it does not allow adopting it here: the evidence the backstop needs before
    # it stops a process claiming that job (gpushare.agent.failsafe)
    refused: dict[str, str] = field(default_factory=dict)

    def due(self, strays: dict[str, dict[int, list[int]]], now: float) -> list[tuple[str, dict[int, list[int]]]]:
        """The stray jobs to look up now, marked as looked up: new processes at once (a requeued job's next
        run appears while its last run's processes were still being refused), the same ones after ``retry_s``."""
        out = []
        for job, where in sorted(strays.items()):
            pids = frozenset(pid for found in where.values() for pid in found)
            when, seen = self._tried.get(job, (-math.inf, frozenset()))
            if now - when >= self.retry_s or not pids <= seen:
                self._tried[job] = (now, pids)
                out.append((job, where))
        if len(self._tried) > MAX_REMEMBERED:
            for job in sorted(self._tried, key=lambda j: self._tried[j][0])[:len(self._tried) - MAX_REMEMBERED]:
                del self._tried[job]
        for job in [j for j in self.refused if j not in self._tried]:
            del self.refused[job]
        return out

    def forget(self, job: str) -> None:
        self._tried.pop(job, None)
        self.refused.pop(job, None)

    def refusal(self, slurm_job: Any, node: str, where: dict[int, list[int]]) -> str | None:
        """Why Slurm's record of the job does not allow adopting it here (None: adopt it)."""
        if slurm_job is None:
            return "Slurm does not know the job"
        if slurm_job.state != "RUNNING":
            return f"its state is {slurm_job.state}"
        try:
            nodes = expand_hostlist(slurm_job.nodes or slurm_job.batch_host, limit=100_000, strict=True)
        except ValueError as exc:
            return f"its node list is unreadable ({exc})"
        if node not in nodes:
            return f"it runs on {slurm_job.nodes or '?'}, not on {node}"
        if slurm_job.user_id is None:
            return "Slurm's record has no user id"
        if not any(re.search(r"\b(?:gpu|shard|mps)\b", text) for text in slurm_job.gpu_requests):
            return "it was granted no GPU (a CPU-only job)"
        owners = {uid for pids in where.values() for uid in map(self.uid_of, pids) if uid is not None}
        if owners != {slurm_job.user_id}:
            return f"its processes belong to uid(s) {sorted(owners)}, the job to uid {slurm_job.user_id}"
        return None
