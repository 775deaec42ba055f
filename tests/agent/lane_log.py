"""Reading lane_worker.py's logs back: when each job held its turn."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

J = TypeVar("J")


def completed_turns(logs: Mapping[J, Iterable[str]]) -> list[tuple[float, float, J]]:
    """(start, end, job) of every completed turn in the jobs' ``start <t>`` / ``end <t>`` lines, in time order."""
    found = []
    for job, lines in logs.items():
        start = None
        for line in lines:
            kind, _, value = line.partition(" ")
            if kind == "start":
                start = float(value)
            elif kind == "end" and start is not None:
                found.append((start, float(value), job))
                start = None
    return sorted(found, key=lambda turn: (turn[0], turn[1]))
