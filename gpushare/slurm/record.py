"""The gpushare record in a job's AdminComment: ``gpushare:{json}``, one reader and one merge for all writers.

Why one module: four writers touch this comment — the submit decision (``decision``, ``est_gib`` …), the
asynchronous estimation (``est_job``), OOM recovery (``oom``) and the node Epilog (``run``) — each by
read-modify-write, and each once had its own prefix, size limit and trimming. ``merge`` keeps every other
writer's keys, never overwrites a comment that is not ours, and keeps the text within ``MAX_CHARS`` so
``scontrol show job`` stays readable. The record holds no free text from the job (reasons are ours).

Format (``v`` 1): ``decision`` (shared|exclusive|estimating|explicit|…), ``old``/``new`` (tres_per_node),
``est_gib``, ``margin_gib``, ``src``, ``why``, ``detail``, ``array``, ``cfg`` (the controller's gpushare.toml
sha256, 12 hex digits), ``est_job``, ``held_s``, ``script``,
``oom`` {n, max, fam, from, to}, ``run`` {node, ttfk_s, energy_j, share_j, peak_gib, exit, caps, ``fin``: 1 in
the node Epilog's final summary},
``lanes`` {p_gib, e_gib, own} (a ``#GPUSHARE lanes`` job: its persistent/ephemeral split, docs/agent.md).
A record of a newer major version than this reader knows is treated as not ours (never rewritten).

Quotes: ``sacctmgr modify job ... set AdminComment=`` stores every ``"`` as a backtick (measured on 22.05, 24.11
and 26.05), so the copy in Slurm's database reads ``gpushare:{`v`:1,...}``. ``render`` therefore writes no
backtick or single quote of its own (inside strings they are ``\u0060``/``\u0027``) and ``parse`` reads both
spellings: turning every backtick back into ``"`` is then exact.

Where the database keeps it: slurmctld sends the job's AdminComment to the accounting database, and sites' own
tools overwrite that copy (Princeton's jobstats EpilogSlurmctld runs an unconditional ``sacctmgr ... set
AdminComment=JS1:...``). So the node Epilog stores the finished job's record in the database's SystemComment
as well (gpushare.epilog.stored_record): no site tool writes it, ``sacctmgr modify job`` sets it on every
supported release, and ``scontrol update`` cannot set it at all (measured on 22.05, 24.11 and 26.05), so a
live job keeps its record in AdminComment. ``stored`` reads both.
"""

from __future__ import annotations

import json
from typing import Any

PREFIX = "gpushare:"
VERSION = 1
MAX_CHARS = 900  # admin_comment stays readable in `scontrol show job`
_TRIM_ORDER = ("detail", "why", "script")  # dropped or shortened first when the record grows too long


def parse(admin_comment: str | None) -> dict[str, Any] | None:
    """Our record from an AdminComment; None when absent, not ours, garbled or of an unknown version."""
    if not admin_comment or not admin_comment.startswith(PREFIX):
        return None
    body = admin_comment[len(PREFIX):]
    if '"' not in body:  # the database's copy, written by sacctmgr (see above)
        body = body.replace("`", '"')
    try:
        record = json.loads(body)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    version = record.get("v", VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version > VERSION:
        return None
    return record


def stored(admin_comment: str | None, system_comment: str | None) -> dict[str, Any] | None:
    """Our record as the accounting database keeps it: the AdminComment record (slurmctld's latest copy of the
    controller's keys, and every record stored before SystemComment was used) with the SystemComment record
    under it, except ``run``: the node Epilog's final summary lives in SystemComment, while the AdminComment
    copy may hold the agent's partial one. None when neither field holds our record."""
    admin, system = parse(admin_comment), parse(system_comment)
    if admin is None and system is None:
        return None
    merged = {**(system or {}), **(admin or {})}
    if system is not None and isinstance(system.get("run"), dict):
        merged["run"] = system["run"]
    return merged


def _dumps(record: dict[str, Any]) -> str:
    text = json.dumps(record, separators=(",", ":"), sort_keys=True)
    return PREFIX + text.replace("`", "\\u0060").replace("'", "\\u0027")  # only inside strings: JSON has none outside


def render(record: dict[str, Any]) -> str | None:
    """``gpushare:{json}`` within ``MAX_CHARS`` (long reasons are trimmed first); None if it cannot fit."""
    record = {"v": VERSION, **record}
    text = _dumps(record)
    for key in _TRIM_ORDER:
        if len(text) <= MAX_CHARS:
            break
        if key == "why" and isinstance(record.get("why"), str):
            record["why"] = record["why"][:80]
        else:
            record.pop(key, None)
        text = _dumps(record)
    return text if len(text) <= MAX_CHARS else None


def merge(existing: str | None, **updates: Any) -> str | None:
    """``existing`` with ``updates`` merged in, or None when the comment is someone else's (left alone)."""
    if existing and parse(existing) is None:
        return None
    return render({**(parse(existing) or {}), **updates})
