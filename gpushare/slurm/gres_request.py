"""Parse and format Slurm's ``tres_per_*`` GRES strings (``gres:gpu:a100:2,gres:shard:4``).

Why by hand: these strings are what job_submit/lua hands us and what it writes back; Slurm 22.05 prints
them as ``gres:<name>[:<type>]:<count>`` (``--gres``) or ``gres/<name>...`` in TRES form, comma-joined.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ITEM_RE = re.compile(r"^(?:gres[:/])?([A-Za-z][\w.-]{0,63})(?::([\w.+-]{1,64}))?(?::(\d{1,9}))?$")


@dataclass(frozen=True)
class GresItem:
    name: str  # "gpu", "shard", "mps", ...
    type: str | None  # "a100", "3g.20gb", or None
    count: int

    def format(self) -> str:
        middle = f":{self.type}" if self.type else ""
        return f"gres:{self.name}{middle}:{self.count}"


def parse_gres(text: str | None) -> list[GresItem]:
    """Parse a tres_per_* string; raises ValueError on anything we do not understand."""
    if not text:
        return []
    items = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        match = _ITEM_RE.match(part)
        if not match:
            raise ValueError(f"unrecognised GRES {part[:80]!r}")
        name, second, count = match.groups()
        if count is None and second is not None and second.isdigit():
            second, count = None, second
        items.append(GresItem(name=name, type=second, count=int(count) if count else 1))
    return items


def format_gres(items: list[GresItem]) -> str:
    return ",".join(item.format() for item in items)


def gpu_like(items: list[GresItem]) -> list[GresItem]:
    return [item for item in items if item.name in ("gpu", "shard", "mps")]
