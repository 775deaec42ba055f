"""What the MIG executor asks of Slurm, as one small interface, and its implementation on the CLIs.

Why an interface (docs/style.md #3, #11): the executor's state machine is tested step by step — with crashes
injected between steps — against a fake that records drains, resumes and restarts; the same code then
drives a real slurmctld/slurmd through :class:`SlurmNodeActions`.

What Slurm 22.05 needs to pick up a changed MIG layout (measured on the local test cluster, see
docs/mig.md "Executor"): new ``gres.conf`` lines *and* the node's ``Gres=`` in slurm.conf, then a
**slurmctld restart** followed by a **slurmd restart**. ``scontrol reconfigure`` is not enough: slurmctld
logs "Attempt to change gres/gpu Count on node n1 from 1 to 4 invalid with File configuration" and keeps
the old count; restarting slurmctld alone leaves the old slurmd reporting fewer GPUs than configured and
the node goes INVAL ("gres/gpu count reported lower than configured (1 < 4)"). A drain survives both
restarts (slurmctld saves node state).

From 24.11 (measured on 24.11.5 and 26.05.5 with a MIG-typed layout change, 7g.40gb → 3g+2g+1g×2)
``scontrol reconfigure`` alone applies the new layout: slurmctld and the slurmds re-execute in place and the
node registers the new types within about 0.3 s, jobs then run on their profiles. The executor tries that
first where the release has it (:meth:`SlurmNodeActions.reconfigure`) and restarts only if Slurm does not
show the new layout: no daemon restart from the node, no ``ssh`` to the controller.
"""

from __future__ import annotations

import logging
import re
import shlex
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable
from typing import Callable, Protocol

from gpushare.mig_manager.gres_files import rewrite_site_node_gres
from gpushare.slurm import nodes
from gpushare.slurm.nodes import gpu_counts
from gpushare.slurm.client import SlurmClient, SlurmError
from gpushare.slurm.jobs import Job

log = logging.getLogger("gpushare.mig")
_REASON_OK = re.compile(r"^[A-Za-z0-9 _.:@#=/+,-]{1,120}$")


@dataclass(frozen=True)
class NodeStatus:
    """A node as slurmctld sees it."""

    state: str  # e.g. "IDLE+DRAIN", "MIXED", "IDLE+DRAIN+INVALID_REG"
    reason: str  # without Slurm's " [user@time]" suffix; "" when none
    gres: str  # the node's configured Gres=, e.g. "gpu:3g.20gb:1,gpu:1g.5gb:2"
    slurmd_started: float | None = None  # SlurmdStartTime: known to slurmctld once that slurmd registered

    @property
    def flags(self) -> set[str]:
        return set(self.state.upper().replace("*", "").split("+"))

    @property
    def drained(self) -> bool:
        return bool(self.flags & {"DRAIN", "DRAINED", "DRAINING"})

    @property
    def invalid(self) -> bool:
        return bool(self.flags & {"INVAL", "INVALID", "INVALID_REG"})


class SlurmActions(Protocol):
    """The executor's view of Slurm for one node."""

    def status(self, node: str) -> NodeStatus: ...
    def drain(self, node: str, reason: str) -> None: ...
    def resume(self, node: str) -> None: ...
    def running_gpu_jobs(self, node: str) -> dict[str, Counter[str]]: ...  # job id -> GPU types held
    def write_gres(self, node: str, lines: list[str], gres: str) -> bool: ...
    def reconfigure(self) -> bool: ...  # False: this release (or the site) needs restart() instead
    def restart(self, node: str) -> None: ...


def run_command(argv: list[str], timeout_s: float = 120.0) -> None:
    """Run an admin-configured command (argument vector, no shell); raise with its stderr on failure."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, errors="replace")
    if proc.returncode != 0:
        raise SlurmError(f"{shlex.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}")


def command_runner(commands: list[str]) -> Callable[[str], None]:
    """A restart callable running ``commands`` (``[mig]`` setting strings) in order, no shell."""
    argvs = [shlex.split(c) for c in commands if c.strip()]

    def restart(node: str) -> None:
        for argv in argvs:
            run_command(argv)
    return restart


def gpu_jobs_on(jobs: Iterable[Job], node: str, hosts: Callable[[str], set[str]]) -> dict[str, Counter[str]]:
    """Running (or completing) jobs on ``node`` and the GPU types they hold, from Slurm's structured records.

    Job fields are user-influenced, so only structured fields are used and every GPU request field
    (--gres, --gpus, --gpus-per-task, --gpus-per-socket) is parsed strictly; a GPU request we cannot
    read as typed counts as holding any instance ("*"), so its instance is never destroyed. A job
    spanning several nodes counts for each (``hosts`` expands its node list).
    """
    out: dict[str, Counter[str]] = {}
    for job in jobs:
        if not job.active or node not in hosts(job.nodes):
            continue
        held: Counter[str] = Counter()
        for request in job.gpu_requests:
            typed = gpu_counts(request)
            held.update(typed)
            if "gpu" in request and not typed:  # untyped or unreadable GPU request: any instance
                held["*"] += 1
        if held:
            out[job.job_id] = held
    return out


class SlurmNodeQueries:
    """What the executor asks of Slurm through its commands alone: node status, drain, resume, the jobs on
    the node. Shared by the file-editing actions below and the node-record actions of controller
    coordination (gpushare.mig_manager.coordination), which must not touch Slurm's files."""

    def __init__(self, client: SlurmClient) -> None:
        self.client = client

    def status(self, node: str) -> NodeStatus:
        fields = nodes.first_record(self.client, node)
        if fields.get("NodeName") != node:
            raise SlurmError(f"scontrol show node {node}: no such node")
        return NodeStatus(fields.get("State", ""), nodes.reason(fields), nodes.value(fields, "Gres"),
                          nodes.timestamp(fields.get("SlurmdStartTime", "")))

    def drain(self, node: str, reason: str) -> None:
        if not _REASON_OK.match(reason):
            raise ValueError(f"drain reason {reason!r}: letters, digits and simple punctuation only")
        self.client.run("scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}")

    def resume(self, node: str) -> None:
        self.client.run("scontrol", "update", f"nodename={node}", "state=resume")

    def running_gpu_jobs(self, node: str) -> dict[str, Counter[str]]:
        """Running (or completing) jobs on ``node`` and the GPU types they hold (:func:`gpu_jobs_on`)."""
        return gpu_jobs_on(self.client.jobs(), node, self.hosts)

    def hosts(self, nodelist: str) -> set[str]:
        if not nodelist or "[" not in nodelist:
            return {n for n in nodelist.split(",") if n}
        return set(self.client.run("scontrol", "show", "hostnames", nodelist).split())


class SlurmNodeActions(SlurmNodeQueries):
    """:class:`SlurmActions` on scontrol/squeue and the configuration files.

    ``restart`` is a callable (tests restart their own daemons); :meth:`with_commands` builds one from the
    ``[mig]`` restart commands, run in that order (slurmctld first, then slurmd, as measured above).
    ``try_reconfigure`` is ``[mig] reconfigure``: False keeps the restart path on every release.
    ``slurm_conf``/``gres_conf`` are the site's files, only read; the writes go to ``includes`` (``[mig]
    slurm_include``/``gres_include``), which they must Include (gpushare.mig_manager.gres_files).
    """

    def __init__(self, client: SlurmClient, slurm_conf: Path, gres_conf: Path,
                 restart: Callable[[str], None], try_reconfigure: bool = True,
                 includes: tuple[str, str] = ("gpushare-mig.conf", "gpushare-mig-gres.conf")) -> None:
        super().__init__(client)
        self.slurm_conf = Path(slurm_conf)
        self.gres_conf = Path(gres_conf)
        self._restart = restart
        self.try_reconfigure = try_reconfigure
        self.includes = includes

    @classmethod
    def with_commands(cls, client: SlurmClient, slurm_conf: Path, gres_conf: Path,
                      commands: list[str], try_reconfigure: bool = True,
                      includes: tuple[str, str] = ("gpushare-mig.conf", "gpushare-mig-gres.conf")
                      ) -> "SlurmNodeActions":
        return cls(client, slurm_conf, gres_conf, command_runner(commands), try_reconfigure, includes)

    def write_gres(self, node: str, lines: list[str], gres: str) -> bool:
        return rewrite_site_node_gres(self.slurm_conf, self.gres_conf, node, lines, gres, *self.includes)

    def reconfigure(self) -> bool:
        """``scontrol reconfigure`` where this release applies a GRES change that way (24.11+); False (and
        nothing run) where it does not, or where the site turned it off."""
        if not (self.try_reconfigure and self.client.version.reconfigure_applies_gres):
            return False
        self.client.run("scontrol", "reconfigure")
        return True

    def restart(self, node: str) -> None:
        self._restart(node)
