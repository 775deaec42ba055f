"""Other papers' published gains (``simulator/data/published_gains.json``), read and checked record by record.

Why a reader: these numbers are reported beside the simulator's (docs/simulator.md, *Calibration*), never fitted
to; each must carry where it was published, so that a number without a source cannot slip into a table. The
file keeps one record per line (as ``carma_targets.json`` does), which lets a bad record be named by file, line
and column, the column of the field at fault (or of the record, for a missing field).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gpushare.errors import GpushareError

NAME = "published_gains.json"
TEXT_FIELDS = ("paper", "venue", "where", "system", "baseline", "setting", "metric")
UNITS = ("ratio", "pct", "GPUs")


class PublishedError(GpushareError, ValueError):
    """A published-gains file that cannot be read as a whole; the message is one line naming the place."""


@dataclass(frozen=True)
class Published:
    """One number a paper states, with where it states it."""

    paper: str
    venue: str
    where: str
    system: str
    baseline: str
    setting: str
    metric: str
    value: float
    unit: str


def load(path: Path) -> list[Published]:
    """Every record of ``path``; the first bad one raises :class:`PublishedError` and nothing is returned."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise PublishedError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PublishedError(f"{path}:{exc.lineno}:{exc.colno}: not JSON: {exc.msg}") from None
    if not isinstance(document, dict) or not isinstance(document.get("targets"), list):
        raise PublishedError(f"{path}:1:1: expected an object with a 'targets' list")
    lines = text.splitlines()
    records = [n for n, line in enumerate(lines, start=1) if line.lstrip().startswith("{") and n > 1]
    if len(records) != len(document["targets"]):
        raise PublishedError(f"{path}:1:1: each record must sit on a line of its own "
                             f"({len(document['targets'])} records on {len(records)} lines)")
    return [_record(path, n, lines[n - 1], raw) for n, raw in zip(records, document["targets"])]


def _record(path: Path, line_no: int, line: str, raw: object) -> Published:
    start = len(line) - len(line.lstrip()) + 1

    def fail(field: str | None, what: str) -> PublishedError:
        at = line.find(f'"{field}"') + 1 if field and f'"{field}"' in line else start
        return PublishedError(f"{path}:{line_no}:{at}: {what}")

    if not isinstance(raw, dict):
        raise fail(None, "a record must be an object")
    unknown = sorted(set(raw) - set(TEXT_FIELDS) - {"value", "unit"})
    if unknown:
        raise fail(unknown[0], f"unknown field {unknown[0]!r}")
    for field in TEXT_FIELDS + ("value", "unit"):
        if field not in raw:
            raise fail(None, f"field {field!r} is missing")
    for field in TEXT_FIELDS:
        if not isinstance(raw[field], str) or not raw[field].strip():
            raise fail(field, f"field {field!r} must be non-empty text, got {raw[field]!r}")
    value = raw["value"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise fail("value", f"field 'value' must be a number, got {value!r}")
    if raw["unit"] not in UNITS:
        raise fail("unit", f"field 'unit' must be one of {', '.join(UNITS)}, got {raw['unit']!r}")
    if raw["unit"] == "ratio" and value <= 0:
        raise fail("value", f"a ratio must be above 0, got {value!r}")
    return Published(**{field: raw[field] for field in TEXT_FIELDS}, value=float(value), unit=raw["unit"])
