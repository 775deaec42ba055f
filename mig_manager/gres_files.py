"""Rewriting one node's GRES in gpushare's own slurm.conf and gres.conf include files, and the nvidia-cap devices.

Why files of our own: the site's slurm.conf and gres.conf belong to its configuration management, which
would undo (or fight) any edit of ours. The site includes our two files once (``Include
/etc/slurm/gpushare-mig.conf`` in slurm.conf, ``Include /etc/slurm/gpushare-mig-gres.conf`` in gres.conf;
Slurm's parser reads ``Include`` in both files on 22.05, 24.11 and 26.05, checked by tests/mig_exec) and moves
the ``NodeName=`` line of each MIG node into the first; the executor writes only those two files and
refuses (:func:`check_site_files`) while the site's files lack the Include or still hold that node's lines.

Why text surgery rather than regenerating them: the include may hold several nodes (and an admin's
comments); a repartition must change exactly this node's ``NodeName=<node> …`` gres.conf lines and the
``Gres=`` of its slurm.conf ``NodeName=`` line, and keep every other byte. The rules are strict so a
surprise is an error, not a silent half-edit:

- gres.conf: every line whose first token is ``NodeName=<node>`` (exactly this node) is replaced by the
  new lines, placed where the first old one was (else at the end). Lines for other nodes, hostlists
  (``NodeName=gpu[01-04]``) and node-less lines are kept untouched; a hostlist or node-less ``Name=gpu``
  line that could also apply to this node is refused, because Slurm would merge it with ours.
- slurm.conf: the node must have its own ``NodeName=<node> …`` line (a hostlist line cannot be changed
  for one node); its ``Gres=`` value is replaced, or added.
Both files are written atomically (same directory, fsync, rename).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from gpushare.errors import GpushareError
from gpushare.atomic import flock_within, write_text_atomic

_GRES_VALUE_RE = re.compile(r"^[A-Za-z0-9_.+:,-]+$")


class GresFileError(GpushareError, RuntimeError):
    """A file this module will not edit as asked; the message says what to change."""


def _first_token(line: str) -> str:
    parts = line.split(None, 1)
    return parts[0] if parts else ""


def _node_of(line: str) -> str | None:
    token = _first_token(line)
    return token.split("=", 1)[1] if token.lower().startswith("nodename=") else None


def replace_gres_conf_lines(text: str, node: str, new_lines: list[str]) -> str:
    """gres.conf text with ``node``'s own lines replaced by ``new_lines`` (each ``NodeName=<node> …``)."""
    for line in new_lines:
        if _node_of(line) != node or "\n" in line:
            raise GresFileError(f"generated gres.conf line does not start with NodeName={node}: {line!r}")
    out: list[str] = []
    placed = False
    for line in text.splitlines():
        stripped = line.strip()
        owner = _node_of(stripped)
        if owner == node:
            if not placed:
                out.extend(new_lines)
                placed = True
            continue
        if stripped and not stripped.startswith("#") and re.search(r"(?i)\bname=gpu\b", stripped) and (
                owner is None or "[" in owner or "," in owner):
            raise GresFileError(f"gres.conf line {stripped!r} may also apply to {node}; give {node} its "
                                "own NodeName= lines so a MIG repartition can rewrite them alone")
        out.append(line)
    if not placed:
        out.extend(new_lines)
    return "\n".join(out) + "\n"


def replace_node_gres(text: str, node: str, gres: str) -> str:
    """slurm.conf text with the ``Gres=`` of ``NodeName=<node>`` set to ``gres``."""
    if not _GRES_VALUE_RE.match(gres):
        raise GresFileError(f"refusing Gres value {gres!r}")
    out, found = [], False
    for line in text.splitlines():
        if _node_of(line.strip()) == node and not line.startswith((" ", "\t")):
            found = True
            if re.search(r"(?i)(^|\s)Gres=\S*", line):
                line = re.sub(r"(?i)(^|\s)Gres=\S*", lambda m: f"{m.group(1)}Gres={gres}", line, count=1)
            else:
                line = f"{line.rstrip()} Gres={gres}"
        out.append(line)
    if not found:
        raise GresFileError(f"no line of its own for node {node} (NodeName={node} ...); give it one in "
                            "[mig] slurm_include, out of any hostlist, so its Gres= can change alone")
    return "\n".join(out) + "\n"


def _includes(site: Path) -> list[Path]:
    """The paths ``site`` names in ``Include`` lines (relative ones from its folder), unexpanded."""
    out = []
    for raw in site.read_text(encoding="utf-8").splitlines():
        parts = raw.split("#", 1)[0].split(None, 1)
        if len(parts) == 2 and parts[0].lower() == "include":
            out.append(site.parent / parts[1].strip())
    return out


def check_site_files(site_slurm: Path, site_gres: Path, own_slurm: Path, own_gres: Path, node: str) -> None:
    """Refuse (one line naming the fix) unless the site's files include ours and leave ``node`` to them.

    Read only: the site's files are never written. A glob Include that matches our file counts."""
    import fnmatch

    for site, own in ((site_slurm, own_slurm), (site_gres, own_gres)):
        if not site.exists():
            raise GresFileError(f"{site}: missing; the MIG executor needs it to include {own}")
        if not any(str(inc) == str(own) or fnmatch.fnmatch(str(own), str(inc)) for inc in _includes(site)):
            raise GresFileError(f"{site} has no line 'Include {own}'; add it once (docs/mig.md, \"Slurm setup\"): "
                                f"gpushare writes {node}'s GRES only into {own}")
    for raw in site_slurm.read_text(encoding="utf-8").splitlines():
        if _node_of(raw.split("#", 1)[0].strip()) == node:
            raise GresFileError(f"{site_slurm} still defines NodeName={node}; move that line into {own_slurm}, "
                                "whose Gres= the MIG executor keeps up to date")
    for raw in site_gres.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        owner = _node_of(line)
        if line and re.search(r"(?i)\bname=gpu\b", line) and (owner == node or owner is None or "[" in owner
                                                              or "," in owner):
            raise GresFileError(f"{site_gres} line {line!r} may also apply to {node}; leave {node}'s gres.conf "
                                f"lines to {own_gres}")


@contextlib.contextmanager
def conf_lock(slurm_conf: Path, timeout_s: float = 120.0) -> Iterator[None]:
    """Exclusive lock for read-modify-write of the cluster's slurm.conf and gres.conf.

    Why a file beside slurm.conf: the per-node journal lock does not stop two nodes' reshapes that
    share one slurm.conf (a shared /etc/slurm) from reading the same text and each writing back only
    its own ``Gres=`` edit. The files themselves are replaced by rename, so their inode cannot carry
    the lock; ``.<name>.gpushare.lock`` beside them is seen by every writer of that file."""
    path = slurm_conf.with_name(f".{slurm_conf.name}.gpushare.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if not flock_within(fd, timeout_s):
            raise GresFileError(f"{path}: held by another reshape for {timeout_s:.0f} s")
        yield
    finally:
        os.close(fd)


def own_files(site_slurm: Path, site_gres: Path, slurm_include: str = "gpushare-mig.conf",
              gres_include: str = "gpushare-mig-gres.conf") -> tuple[Path, Path]:
    """Our two include files (``[mig] slurm_include``/``gres_include``; relative: beside the site's file)."""
    return site_slurm.parent / slurm_include, site_gres.parent / gres_include


def rewrite_site_node_gres(site_slurm: Path, site_gres: Path, node: str, lines: list[str], gres: str,
                           slurm_include: str = "gpushare-mig.conf",
                           gres_include: str = "gpushare-mig-gres.conf") -> bool:
    """:func:`rewrite_node_gres` on our include files, after :func:`check_site_files` (the site's files read only)."""
    own_slurm, own_gres = own_files(site_slurm, site_gres, slurm_include, gres_include)
    check_site_files(site_slurm, site_gres, own_slurm, own_gres, node)
    if not own_slurm.exists():
        raise GresFileError(f"{own_slurm}: missing; move NodeName={node}'s line from slurm.conf into it")
    return rewrite_node_gres(own_slurm, own_gres, node, lines, gres)


def rewrite_node_gres(slurm_conf: Path, gres_conf: Path, node: str, lines: list[str], gres: str) -> bool:
    """Apply both edits under :func:`conf_lock`; returns whether anything changed (no write when equal)."""
    with conf_lock(slurm_conf):
        return _rewrite_node_gres(slurm_conf, gres_conf, node, lines, gres)


def _rewrite_node_gres(slurm_conf: Path, gres_conf: Path, node: str, lines: list[str], gres: str) -> bool:
    old_slurm = slurm_conf.read_text(encoding="utf-8")
    old_gres = gres_conf.read_text(encoding="utf-8") if gres_conf.exists() else ""
    new_slurm = replace_node_gres(old_slurm, node, gres)
    new_gres = replace_gres_conf_lines(old_gres, node, lines)
    changed = False
    if new_gres != old_gres:
        write_text_atomic(gres_conf, new_gres, mode=stat.S_IMODE(gres_conf.stat().st_mode)
                          if gres_conf.exists() else 0o644)
        changed = True
    if new_slurm != old_slurm:
        write_text_atomic(slurm_conf, new_slurm, mode=stat.S_IMODE(slurm_conf.stat().st_mode))
        changed = True
    return changed


def ensure_cap_devices(dev_dir: str | Path, minors: list[int], major: int) -> list[Path]:
    """Create missing ``<dev_dir>/nvidia-caps/nvidia-cap<minor>`` character devices (major ``major``).

    On a real node the driver's nvidia-modprobe makes these; simulated nodes and sites whose udev does
    not need this call, so it is opt-in (``[mig] cap_device_major``). An existing path that is not a
    character device of that major is an error: Slurm would hand the wrong device to jobs.
    """
    caps = Path(dev_dir) / "nvidia-caps"
    caps.mkdir(mode=0o755, exist_ok=True)
    made = []
    for minor in sorted(set(minors)):
        path = caps / f"nvidia-cap{int(minor)}"
        try:
            st = path.lstat()
        except FileNotFoundError:
            os.mknod(path, 0o444 | stat.S_IFCHR, os.makedev(major, int(minor)))
            made.append(path)
            continue
        if not stat.S_ISCHR(st.st_mode) or os.major(st.st_rdev) != major or os.minor(st.st_rdev) != minor:
            raise GresFileError(f"{path} exists but is not character device {major}:{minor}; remove it")
    return made
