"""What gpushare's controller side needs to know from slurm.conf itself: the account slurmctld runs as.

Why the file and not ``scontrol show config``: gpushare-submitd starts before slurmctld (its unit is
``Before=slurmctld.service``) and must already have its socket's group right when slurmctld's first job
arrives; ``gpushare doctor`` must also say what is wrong while slurmctld is down.

Slurm's grammar, as far as this reader needs it (slurm.conf(5)): one ``Key=Value`` per item, keys
case-insensitive, ``#`` starts a comment, several items may share a line, the last setting of a key wins,
and ``Include PATH`` (relative to the including file's folder, shell globs allowed) reads another file in
place. ``SlurmUser`` defaults to ``root``.
"""

from __future__ import annotations

import glob
import grp
import os
import pwd
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from gpushare.errors import GpushareError

MAX_INCLUDE_DEPTH = 8  # Slurm itself nests includes; a loop must end in an error, not a recursion crash
_INCLUDE = re.compile(r"^\s*include\s+(.+?)\s*$", re.IGNORECASE)


class SlurmConfError(GpushareError, ValueError):
    """slurm.conf could not be read; the message names the file."""


def read_keys(path: str | os.PathLike[str]) -> dict[str, str]:
    """Every ``Key=Value`` of ``path`` and its includes, keys lower-cased, the last setting winning."""
    return dict(read_settings(path))


def read_settings(path: str | os.PathLike[str], _depth: int = 0) -> list[tuple[str, str]]:
    """Every ``Key=Value`` of ``path`` and its includes in file order, keys lower-cased, repeats kept.

    Why beside read_keys: since Slurm 24.05 Prolog, Epilog, PrologSlurmctld and EpilogSlurmctld may each
    be given on several lines, and every one of them runs; the last setting does not win there."""
    if _depth > MAX_INCLUDE_DEPTH:
        raise SlurmConfError(f"{path}: Include nested more than {MAX_INCLUDE_DEPTH} deep")
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise SlurmConfError(f"{path}: {exc.strerror or exc}") from exc
    found: list[tuple[str, str]] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        include = _INCLUDE.match(line)
        if include:
            target = include.group(1)
            if not os.path.isabs(target):
                target = os.path.join(os.path.dirname(os.fspath(path)), target)
            for name in sorted(glob.glob(target)) or [target]:
                found.extend(read_settings(name, _depth + 1))
            continue
        try:
            items = shlex.split(line)
        except ValueError:
            items = line.split()
        for item in items:
            key, sep, value = item.partition("=")
            if sep:
                found.append((key.strip().lower(), value.strip()))
    return found


@dataclass(frozen=True)
class Account:
    """A local account: slurmctld's (SlurmUser) as this host's passwd and group databases know it."""

    name: str
    uid: int
    gid: int  # its primary group
    group: str


def account(name: str) -> Account:
    """``name`` (or a numeric uid) looked up here; SlurmConfError when this host has no such account."""
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, ValueError) as exc:
        raise SlurmConfError(f"SlurmUser {name!r} is not an account on this host") from exc
    try:
        group = grp.getgrgid(entry.pw_gid).gr_name
    except KeyError:
        group = str(entry.pw_gid)
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, group)


def slurm_user(conf_path: str | os.PathLike[str] | None) -> Account:
    """The account slurmctld runs as (and with it the shim, PrologSlurmctld, EpilogSlurmctld and MailProg).

    ``conf_path`` None: Slurm's built-in default file, /etc/slurm/slurm.conf."""
    keys = read_keys(conf_path or "/etc/slurm/slurm.conf")
    return account(keys.get("slurmuser") or "root")
