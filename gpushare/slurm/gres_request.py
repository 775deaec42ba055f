"""Parse and format Slurm's ``tres_per_*`` GRES strings (``gres:gpu:a100:2,gres:shard:4``).

Why by hand: these strings are what job_submit/lua hands us and what it writes back. Slurm 22.05 prints
them as ``gres:<name>[:<type>]:<count>``; 23.02 and later as ``gres/<name>...``, and each release refuses
the other form when it is written back ("Invalid Trackable RESource (TRES) specification"). So an item
keeps the separator it came with, and an item made to replace another takes over that one's
(:meth:`GresItem.replaced`): the submit path needs no knowledge of the release.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

_ITEM_RE = re.compile(r"^(gres[:/])?([A-Za-z][\w.-]{0,63})(?::([\w.+-]{1,64}))?(?::(\d{1,9}))?$",
                      re.ASCII)  # ASCII only: '²' passes str.isdigit and fails int()


@dataclass(frozen=True)
class GresItem:
    name: str  # "gpu", "shard", "mps", ...
    type: str | None  # "a100", "3g.20gb", or None
    count: int
    prefix: str = "gres:"  # "gres:" (22.05), "gres/" (23.02+), or "" (as users type --gres)

    def format(self) -> str:
        middle = f":{self.type}" if self.type else ""
        return f"{self.prefix}{self.name}{middle}:{self.count}"

    def plain(self) -> str:
        """``shard:8`` / ``gpu:a100:1``: as ``--gres`` and ``scontrol update gres=`` take it on every release."""
        return replace(self, prefix="").format()

    def replaced(self, name: str, type: str | None, count: int) -> "GresItem":
        """Another request in this item's place, written with this item's separator."""
        return GresItem(name, type, count, self.prefix)


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
        prefix, name, second, count = match.groups()
        if count is None and second is not None and second.isdigit():
            second, count = None, second
        items.append(GresItem(name=name, type=second, count=int(count) if count else 1, prefix=prefix or ""))
    return items


@dataclass(frozen=True)
class GresRequest:
    """A job's per-node GRES request, parsed once where it leaves Slurm (``Job.gres_per_node``) and passed on
    as this value: the text as Slurm printed it (what records, logs and the ledger keep, unchanged) and its
    items. Text that does not parse gives no items and ``error`` says why, so no reader needs to parse it
    again or guard against ValueError."""

    text: str = ""  # "gres:shard:12" / "gres/shard:12"; "" when the job asked for no per-node GRES
    items: tuple[GresItem, ...] = ()
    error: str = ""  # why ``text`` was not understood ("" when it was)

    @classmethod
    def parse(cls, text: str | None) -> "GresRequest":
        try:
            return cls(text or "", tuple(parse_gres(text)))
        except ValueError as exc:
            return cls(text or "", (), str(exc))

    def named(self, name: str) -> list[GresItem]:
        """The items of this GRES name (``gpu``, ``shard``, ...)."""
        return [item for item in self.items if item.name == name]

    def plain(self) -> str:
        """``shard:8,gpu:1``: the items without their ``gres:``/``gres/`` separators, as ``--gres`` and
        ``scontrol update gres=`` take them on every release."""
        return ",".join(item.plain() for item in self.items)


def format_gres(items: list[GresItem]) -> str:
    return ",".join(item.format() for item in items)


def plain_gres(text: str) -> str:
    """A tres_per_node value without its ``gres:``/``gres/`` separators (``shard:40,gpu:1``)."""
    return ",".join(item.plain() for item in parse_gres(text))
