"""Slurm hostlist expressions (``gpu[01-03,07],cpu1``), expanded without calling ``scontrol``.

Why by hand: hooks expand the node list of every finished job and the config names node groups the same
way; a subprocess per expansion would cost more than the hook's own work. One bracket group per name is
what site configs use; anything else is an error in ``strict`` mode (the config) and skipped otherwise
(job node lists, where a guess is better than a crash).
"""

from __future__ import annotations

import re

from gpushare.errors import GpushareError


class HostlistError(GpushareError, ValueError):
    """A hostlist we cannot expand; the message names the expression and the part."""


def _names(expr: str) -> list[str]:
    """Split on the commas outside brackets: ``gpu[01-03,07],cpu1`` → ``["gpu[01-03,07]", "cpu1"]``."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(expr):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(expr[start:index])
            start = index + 1
    parts.append(expr[start:])
    return [part for part in parts if part]


def expand_hostlist(expr: str, limit: int = 100_000, strict: bool = False) -> list[str]:
    """``gpu[01-03,07],cpu1`` → ``["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]`` (at most ``limit``)."""
    found: list[str] = []
    for part in _names(expr or ""):
        match = re.fullmatch(r"([^\[\]]*)\[([0-9,\-]+)\]([^\[\]]*)", part)
        if match is None:
            if "[" in part or "]" in part:
                if strict:
                    raise HostlistError(f"hostlist {expr!r}: cannot expand {part!r}; list the nodes one by one")
                continue
            found.append(part)
            if len(found) >= limit:
                return found
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
                if strict:
                    raise HostlistError(f"hostlist {expr!r}: bad range {item!r}")
                continue
            for number in range(int(low), int(high or low) + 1):
                found.append(f"{prefix}{number:0{len(low)}d}{suffix}")
                if len(found) >= limit:
                    return found
    return found


def first_host(expr: str) -> str:
    names = expand_hostlist(expr, limit=1)
    return names[0] if names else ""
