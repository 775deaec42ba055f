"""The queue as ``sinfo`` and ``squeue`` print it for gpushare-submitd's queue view: idle whole GPUs per node
and partition (``sinfo -N -O ...,Gres,GresUsed``) and the GPUs pending jobs ask for (``squeue -t PD -O ...``).

Allocated GPU indices differ between releases: ``sinfo -O GresUsed`` prints
``gpu:a100:1(IDX:1),shard:a100:1(IDX:0)`` on 22.05; 23.02+ print shards per GPU, ``shard:a100:5(5/40,0/40)``.
What counts as an idle GPU: on a node in state idle or mixed, a GPU index that appears neither in the node's
allocated ``gpu`` nor in its allocated ``shard`` indices. The view itself (its refresh thread, staleness and
claims) is gpushare.slurm_plugins.queue_view.
"""

from __future__ import annotations

import re

USABLE_STATES = ("idle", "mixed")
SINFO_ARGS = ("-h", "-N", "-O", "NodeList:|,Partition:|,StateLong:|,Gres:|,GresUsed:")
SQUEUE_ARGS = ("-h", "-t", "PD", "-O", "Partition:|,tres-per-node:|,tres-per-job:|,NumNodes:|,Reason:")
HELD_REASONS = ("JobHeld", "Dependency", "BeginTime", "DependencyNeverSatisfied", "launch failed")
_IDX = re.compile(r"IDX:([^)]*)")
_PER_GPU = re.compile(r"\((\d+/\d+(?:,\d+/\d+)*)\)")


def _items(gres: str) -> list[str]:
    """``gpu:a100:2(S:0-1),shard:a100:80`` -> its comma-separated items, commas inside brackets kept."""
    items, depth, current = [], 0, ""
    for ch in gres:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    return [*items, current] if current else items


def _indices(text: str) -> set[int]:
    """``0-1,3`` -> {0, 1, 3}; ``N/A`` or junk -> empty."""
    found: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (hi.isdigit() or not hi):
            found.update(range(int(lo), int(hi or lo) + 1))
    return found


def _count(item: str) -> int:
    head = item.split("(", 1)[0].split(":")
    return int(head[-1]) if len(head) > 1 and head[-1].isdigit() else (1 if len(head) == 1 else 0)


def idle_gpus(gres: str, gres_used: str) -> int:
    """Whole GPUs of one node that hold neither a ``gpu`` nor a ``shard`` allocation."""
    total = sum(_count(item) for item in _items(gres) if item.split(":", 1)[0] == "gpu")
    busy: set[int] = set()
    for item in _items(gres_used):
        name = item.split(":", 1)[0]
        if name in ("gpu", "shard") and _count(item) > 0:
            match = _IDX.search(item)
            if match:  # 22.05, and gpu on every release: the indices in use
                busy |= _indices(match.group(1))
            elif found := _PER_GPU.search(item):  # shard on 23.02+: used/total per GPU, in index order
                busy |= {i for i, pair in enumerate(found.group(1).split(",")) if not pair.startswith("0/")}
    return max(0, total - len(busy))


def parse_sinfo(text: str) -> tuple[dict[str, dict[str, int]], str | None]:
    """``sinfo -N -O NodeList,Partition,StateLong,Gres,GresUsed`` (``|``-separated) -> idle GPUs and the
    default partition (the one sinfo marks with ``*``)."""
    idle: dict[str, dict[str, int]] = {}
    default = None
    for line in text.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) < 5 or not fields[0]:
            continue
        node, partition, state, gres, used = fields[:5]
        if partition.endswith("*"):
            partition = partition[:-1]
            default = partition
        usable = state.rstrip("*~#!%$@^-").lower() in USABLE_STATES
        idle.setdefault(partition, {})[node] = idle_gpus(gres, used) if usable else 0
    return idle, default


def _gpus_asked(tres: str) -> int:
    """GPUs one node's (or one job's) TRES string asks for: ``gres:gpu:2``, ``gres/gpu:a100:1``; a shared
    request (``shard``, ``mps``) counts one GPU."""
    asked = 0
    for item in tres.replace("gres/", "gres:").split(","):
        parts = item.split(":")
        if parts and parts[0] == "gres":
            parts = parts[1:]
        if not parts or parts[0] not in ("gpu", "shard", "mps"):
            continue
        count = int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
        asked += count if parts[0] == "gpu" else 1
    return asked


def parse_squeue(text: str) -> dict[str, int]:
    """``squeue -t PD -O Partition,tres-per-node,tres-per-job,NumNodes,Reason`` -> GPUs pending per
    partition. Held jobs and jobs waiting for a dependency or a start time are not demand yet."""
    pending: dict[str, int] = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) < 5 or not fields[0]:
            continue
        partitions, per_node, per_job, nodes, reason = fields[:5]
        if reason.startswith(HELD_REASONS):
            continue
        count = int(nodes) if nodes.isdigit() else 1
        asked = _gpus_asked(per_node) * count + _gpus_asked(per_job)
        for partition in partitions.split(","):
            if asked:
                pending[partition] = pending.get(partition, 0) + asked
    return pending
