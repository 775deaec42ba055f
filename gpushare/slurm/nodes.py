"""Nodes as Slurm's tools print them: ``scontrol show node -o`` records and the GPU types ``sinfo %G`` lists.

Why here: a new Slurm release that prints a node differently is then met in one module. The MIG executor
(status, drain reason, node records of controller coordination), the agent's withheld-feature switch and
the controller Epilog's choice of a larger MIG profile all read nodes through these functions; they take any
object with the client's ``run(tool, *args) -> stdout`` (:class:`gpushare.slurm.client.SlurmClient`).
"""

from __future__ import annotations

import datetime
import re
from collections import Counter
from typing import Protocol

from gpushare.slurm.jobs import parse_scontrol_record

SINFO_GRES_ARGS = ("-h", "-o", "%G")
_GPU_TYPE = re.compile(r"gpu:([\w.+-]+):\d")
_GRES_ITEM = re.compile(r"^(?:gres[:/])?gpu:([A-Za-z0-9_.+-]{1,40}):(\d{1,4})(?:\(.*\))?$")
_REASON_SUFFIX = re.compile(r"\s*\[[^\]]*@[^\]]*\]\s*$")  # " [root@2026-11-22T03:19:09]" after a Reason


class Runs(Protocol):
    def run(self, tool: str, *args: str) -> str: ...


def show_node(client: Runs, node: str | None = None) -> list[dict[str, str]]:
    """Every node's ``scontrol show node -o`` record (one call), or ``node``'s; records without a NodeName
    are skipped, so an unknown node gives []."""
    out = client.run("scontrol", "show", "node", "-o", *([node] if node else []))
    return [fields for fields in (parse_scontrol_record(line) for line in out.splitlines() if line.strip())
            if fields.get("NodeName")]


def first_record(client: Runs, node: str) -> dict[str, str]:
    """``node``'s record as the first line of ``scontrol show node -o NODE`` prints it ({} when none)."""
    out = client.run("scontrol", "show", "node", "-o", node)
    return parse_scontrol_record(out.splitlines()[0] if out.strip() else "")


def value(fields: dict[str, str], key: str) -> str:
    """A field's text, "" for Slurm's ``(null)`` or an absent key."""
    text = fields.get(key, "")
    return "" if text == "(null)" else text


def reason(fields: dict[str, str]) -> str:
    """The node's Reason without Slurm's `` [user@time]`` suffix; "" when none."""
    text = _REASON_SUFFIX.sub("", fields.get("Reason", "")).strip()
    return "" if text == "(null)" else text


def timestamp(text: str) -> float | None:
    """Slurm's local ``2026-11-26T09:20:53`` as seconds since the epoch; None for ``None``/``Unknown``."""
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def features(text: str | None) -> list[str]:
    """A node's ``AvailableFeatures``/``ActiveFeatures`` as a list ([] for ``(null)``)."""
    if not text or text == "(null)":
        return []
    return [f for f in text.split(",") if f]


def gpu_counts(gres: str) -> Counter[str]:
    """Typed GPUs of a node's ``Gres=`` or a job's GPU request: ``gpu:3g.20gb:1,gpu:1g.5gb:2`` →
    {"3g.20gb": 1, "1g.5gb": 2}; other GRES, untyped GPUs and junk are ignored."""
    counts: Counter[str] = Counter()
    for item in gres.split(","):
        match = _GRES_ITEM.match(item.strip())
        if match:
            counts[match.group(1).lower()] += int(match.group(2))
    return counts


def gpu_types(sinfo_gres: str) -> set[str]:
    """The typed GPUs in ``sinfo -h -o %G`` output (``gpu:3g.20gb:2(S:0),shard:...``) -> {"3g.20gb"}."""
    return {m.group(1) for m in _GPU_TYPE.finditer(sinfo_gres)}


def offered_gpu_types(client: Runs) -> set[str]:
    """GPU types the cluster's nodes offer (one ``sinfo %G``); the client's errors pass through."""
    return gpu_types(client.run("sinfo", *SINFO_GRES_ARGS))
