"""Option values shared by gpushare's subcommands, read once so that every command accepts and refuses the same
text with the same message (``gpushare jobstats --since`` and ``gpushare pilot report --since`` ask the accounting
database for the same kind of period)."""

from __future__ import annotations

import re
from datetime import datetime, timedelta

import click


def since_time(text: str, now: datetime) -> datetime:
    """The start of a reporting period as an admin types ``--since``: ``7d``, ``12h``, ``30m`` before ``now``,
    or an ISO date/time; anything else is a usage error that names the option and what it accepts."""
    found = re.fullmatch(r"(\d+)([dhm])", text.strip())
    if found:
        amount, unit = int(found.group(1)), found.group(2)
        return now - timedelta(**{{"d": "days", "h": "hours", "m": "minutes"}[unit]: amount})
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(f"{text!r}: use 7d, 12h, 30m or an ISO date", param_hint="--since") from None
