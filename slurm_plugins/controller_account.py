"""slurmctld's own account (SlurmUser) and what our controller-side hooks need from root because of it.

Why: the distributions' packages run slurmctld as ``slurm``, and with it everything slurmctld starts: the
job_submit shim (which connects to gpushare-submitd's socket), EpilogSlurmctld (which writes the OOM ledger,
the learned floor in the estimate cache and its log) and MailProg. None of them may become root, so the
one root service on the controller, gpushare-submitd, prepares at its start what they need: the socket's
group, and the directories they write, owned by SlurmUser. Nothing is made world-writable or -readable.

A directory that already exists with another owner is left as it is (an admin may have chosen it) and
reported once; ``gpushare doctor`` reports it too, with the command that fixes it.
"""

from __future__ import annotations

import grp
import logging
import os
from pathlib import Path

from gpushare.config import Config
from gpushare.estimate import cache as estimate_cache
from gpushare.slurm.conf_file import Account, SlurmConfError, slurm_user

log = logging.getLogger("gpushare.submitd")


def controller_account(cfg: Config) -> Account | None:
    """slurm.conf's SlurmUser as this host knows it; None (logged) when slurm.conf or the account is missing."""
    try:
        return slurm_user(cfg.slurm_conf_path())
    except SlurmConfError as exc:
        log.error("cannot tell slurmctld's account (%s): only root and [submit] peer_uids may connect", exc)
        return None


def socket_gid(cfg: Config, account: Account | None) -> int | None:
    """The group that may connect: ``[submit] socket_group``, else SlurmUser's primary group."""
    if cfg.submit.socket_group:
        name = cfg.submit.socket_group
        try:
            return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
        except KeyError:
            log.error("[submit] socket_group %r is not a group on this host: the socket keeps its own group", name)
            return None
    return account.gid if account else None


def hook_paths(cfg: Config) -> list[tuple[Path, int, bool]]:
    """(path, mode, is_directory) for what the SlurmUser-run hooks write on the controller."""
    paths = [(Path(cfg.oom.ledger_dir), 0o700, True), (estimate_cache.directory(cfg), 0o755, True)]
    if cfg.oom.log_file:
        paths.append((Path(cfg.oom.log_file), 0o640, False))
    return paths


def ownership_problems(cfg: Config, account: Account) -> list[str]:
    """One line, with its fix, per path the SlurmUser-run hooks write that is missing or another's."""
    problems = []
    for path, _mode, _is_dir in hook_paths(cfg):
        try:
            owner = path.stat().st_uid
        except FileNotFoundError:
            problems.append(f"{path} is missing: gpushare-submitd creates it for {account.name} at its start")
            continue
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror or exc}")
            continue
        if owner != account.uid:
            problems.append(f"{path} is owned by uid {owner}, but EpilogSlurmctld runs as {account.name}: "
                            f"chown -R {account.name}:{account.group} {path}")
    return problems


def prepare_hook_paths(cfg: Config, account: Account | None) -> list[str]:
    """Create what is missing, owned by SlurmUser; log and return one line per path still not right."""
    if account is None or account.uid == 0 or os.geteuid() != 0:
        return []
    for path, mode, is_dir in hook_paths(cfg):
        if path.exists():
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if is_dir:
                path.mkdir(mode=mode)
            else:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, mode))
            os.chown(path, account.uid, account.gid)
            os.chmod(path, mode)
            log.info("created %s for %s (EpilogSlurmctld writes it)", path, account.name)
        except OSError as exc:
            log.error("%s: %s", path, exc.strerror or exc)
    problems = ownership_problems(cfg, account)
    for line in problems:
        log.error("%s", line)
    return problems
