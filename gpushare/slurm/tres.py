"""A job's ``AllocTRES`` as ``sacct``/``scontrol show job`` print it: ``billing=1,cpu=1,gres/gpu=1,
gres/gpu:a100-40gb=1,mem=100M,node=1`` or ``...,gres/shard=9,...``.

Slurm lists each GRES once untyped (the total) and once per type; only ``gpu`` and ``shard`` matter here.
"""

from __future__ import annotations

import re
from typing import Any

_TRES = re.compile(r"gres/(gpu|shard)(?::([^=,]+))?=(\d+)")


def gpu_tres(alloc_tres: str) -> dict[str, Any]:
    """``{"gpu": N, "shard": N, "type": "a100-40gb"}`` (keys present only when printed): the untyped totals,
    and the first GPU type named."""
    out: dict[str, Any] = {}
    for kind, gpu_type, count in _TRES.findall(alloc_tres or ""):
        if gpu_type:
            out.setdefault("type", gpu_type)
        else:
            out[kind] = int(count)
    return out


def gpu_tres_counts(alloc_tres: str) -> dict[str, int]:
    """``{"gpu": N, "shard": N}`` with typed entries counted too, the last one printed winning (the trace
    reader's reading: a hand-written trace may name only typed GPUs)."""
    return {kind: int(count) for kind, _, count in _TRES.findall(alloc_tres or "")}
