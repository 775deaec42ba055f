"""Withholding busy GPUs from new shared jobs on Slurm 22.05: a node feature the agent toggles.

Slurm picks the GPU, and Slurm 22.05 gives an outside process no per-GPU lever at run time (file-backed
GRES counts cannot be changed by ``scontrol update``; typed per-GPU GRES are static; a blocker job cannot
target one GPU). What it does offer is a node's *active features*, which ``scontrol update NodeName=N
ActiveFeatures=…`` changes in slurmctld at once, and a job constraint that scheduling honours:

- every GPU node lists ``gpushare_open`` (``[agent] withhold_feature``) in ``Features=``;
- job_submit.lua adds that feature to the constraint of every job it turned into a shared request;
- the agent removes it from the node's active features while the node is *withheld* and puts it back
  once calm; pending shared jobs then wait (``ReqNodeNotAvail``), exclusive jobs are untouched.

Granularity is the node, not the GPU: with ``withhold_node_when = "any"`` (default) one risky or warming
GPU closes the whole node to new shared jobs, which guarantees no shared job lands on it, at the price of
idle shards on the node's other GPUs for about TTFK + one window after each placement; ``"all"`` closes
the node only when no GPU is open, keeping packing high but letting Slurm's first-fit put a job on a busy
GPU of a partly open node. Measured on 22.05 (tests/agent): a submission whose feature is active on *no*
node of its partition is refused ("Requested node configuration is not available"), so the generated
slurm.conf also declares one hidden ``State=FUTURE`` standby node with the feature and the shape of the
largest GPU node: it keeps submissions valid while every real node is withheld and never runs a job.

Assert, then apply (docs/style.md #4): the node's features are read first and ``scontrol`` runs only when they
differ from what they should be; other features of the node are kept as they are.
"""

from __future__ import annotations

import logging
import re

from gpushare.slurm.client import SlurmClient, SlurmError
from gpushare.slurm.nodes import features, first_record

log = logging.getLogger("gpushare.agent")
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class NodeFeature:
    """Reads and sets one feature of one node's ActiveFeatures through scontrol."""

    def __init__(self, client: SlurmClient, node: str, feature: str) -> None:
        if not _NODE_RE.match(node):
            raise ValueError(f"not a node name: {node[:40]!r}")
        self.client = client
        self.node = node
        self.feature = feature
        self.applied: bool | None = None  # what we last saw or set

    def read(self) -> tuple[list[str], list[str]]:
        """(available, active) features of the node; admin-set text, not user input."""
        fields = first_record(self.client, self.node)
        return features(fields.get("AvailableFeatures")), features(fields.get("ActiveFeatures"))

    def apply(self, want_open: bool) -> bool:
        """Make the feature active iff ``want_open``; True when scontrol had to change something."""
        available, active = self.read()
        if self.feature not in available:
            if self.applied is not False:
                log.error("node %s lacks feature %s in Features=: shared jobs cannot be withheld there "
                          "(add it with `gpushare slurm-config`)", self.node, self.feature)
            self.applied = False
            return False
        is_open = self.feature in active
        self.applied = want_open
        if is_open == want_open:
            return False
        new = [f for f in active if f != self.feature] + ([self.feature] if want_open else [])
        try:
            self.client.run("scontrol", "update", f"NodeName={self.node}", f"ActiveFeatures={','.join(new)}")
        except SlurmError as exc:
            log.error("could not %s node %s for shared jobs: %s", "open" if want_open else "close", self.node, exc)
            self.applied = None
            return False
        log.info("node %s %s new shared jobs", self.node, "accepts" if want_open else "withheld from")
        return True


STANDBY_PREFIX = "gpushare-standby-"


def standby_node_line(partition: str, feature: str, gres: str, cpus: int = 0, real_memory_mb: int = 0) -> str:
    """The hidden FUTURE node that keeps shared submissions valid while every real node is withheld.

    It must satisfy any shared job's request (so it copies the GPU node's GRES and, where the site set
    them, CPUs and memory; otherwise it declares generous ones) and never runs anything: FUTURE nodes are
    not scheduled and ``sinfo`` does not list them.
    """
    return (f"NodeName={STANDBY_PREFIX}{partition} State=FUTURE Features={feature} Gres={gres} "
            f"CPUs={cpus or 1024} RealMemory={real_memory_mb or 4194304}")
