"""Which Slurm a local cluster runs, and how to start its processes and tools.

Why: the project must work with every Slurm that Debian ships (22.05 on the host, 24.11 and 26.05 in cached
chroots, see :mod:`devcluster.chroot`). A :class:`SlurmRuntime` hides the difference from the cluster
harness: on the host it runs commands as they are; for a chroot version it prefixes them with the cluster's
``chroot-run`` script and provides wrapper scripts for the client tools (a 22.05 ``sbatch`` cannot talk to a
24.11 controller), which the harness puts first on PATH and hands to :class:`SlurmClient` as its bin_dir.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from devcluster import chroot, slots

ENV_VAR = "GPUSHARE_TEST_SLURM"
HOST = "22.05"  # the value meaning "the host's own packages" (Debian 12 ships 22.05)
VERSIONS = (HOST, *sorted(chroot.SUITES))
HOST_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
_HOST_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin:/sbin:/bin"


def requested_version() -> str:
    """The Slurm version to test against: ``$GPUSHARE_TEST_SLURM`` (``22.05``, ``24.11``, ``26.05``)."""
    value = os.environ.get(ENV_VAR, "").strip() or HOST
    return HOST if value == "host" else value


def version_tuple(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise ValueError(f"not a Slurm version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def at_least(version: str, minimum: str) -> bool:
    return version_tuple(version) >= version_tuple(minimum)


def tres(version: str, gres: str) -> str:
    """How Slurm ``version`` prints a per-node GRES request (scontrol's TresPerNode, Lua's tres_per_node).

    ``tres("22.05", "shard:4")`` → ``"gres:shard:4"``; from 23.02 on Slurm writes ``"gres/shard:4"``. The one
    place tests turn an expected GRES into the running version's spelling.
    """
    prefix = "gres/" if at_least(version, "23.02") else "gres:"
    return ",".join(prefix + item for item in gres.split(","))


@lru_cache(maxsize=1)
def host_release() -> str:
    """The host's Slurm release (``"22.05.8"``), empty when slurmctld is not installed."""
    binary = shutil.which("slurmctld", path=_HOST_PATH)
    if not binary:
        return ""
    proc = subprocess.run([binary, "-V"], capture_output=True, text=True)
    match = re.search(r"(\d+\.\d+\.\S+)", proc.stdout + proc.stderr)
    return match.group(1) if match else ""


#: The account slurmctld and slurmdbd run as in every test cluster, as Debian's and RHEL's packages have it
#: (SlurmdUser stays root, as sites run it); its state, spool, log and pid directories are its own.
SLURM_USER = "slurm"


def slurm_account() -> "pwd.struct_passwd":
    """SLURM_USER, created the way Debian's slurm packages do (uid/gid 64030) where the host lacks it."""
    try:
        return pwd.getpwnam(SLURM_USER)
    except KeyError:
        pass
    with slots.host_lock("users"):  # another test session may be adding it
        try:
            return pwd.getpwnam(SLURM_USER)
        except KeyError:
            subprocess.run(["groupadd", "--system", "--gid", "64030", SLURM_USER], check=False, capture_output=True)
            subprocess.run(["useradd", "--system", "--uid", "64030", "--gid", SLURM_USER, "--no-create-home",
                            "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", SLURM_USER],
                           check=True, capture_output=True)
            return pwd.getpwnam(SLURM_USER)


def own_by_slurm(path: Path, mode: int, directory: bool = True) -> Path:
    """``path`` (a directory, or an empty file) created if missing, owned by SLURM_USER with ``mode``."""
    account = slurm_account()
    if directory:
        path.mkdir(parents=True, exist_ok=True)
    elif not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    os.chown(path, account.pw_uid, account.pw_gid)
    os.chmod(path, mode)
    return path


def traversable_below_tmp(path: Path) -> None:
    """Let SLURM_USER reach ``path``: a cluster made in pytest's 0700 /tmp/pytest-of-root/... is out of its
    reach. Adds search permission only (o+x, never read), and only to folders under /tmp."""
    for folder in [path, *path.parents]:
        if folder == Path("/tmp") or Path("/tmp") not in folder.parents:
            continue
        mode = folder.stat().st_mode
        if not mode & 0o001:
            os.chmod(folder, (mode & 0o7777) | 0o011)


def unreachable_folder(path: Path, user: str) -> Path | None:
    """The outermost folder on the way to ``path`` that ``user`` cannot pass (no search permission), ``path``
    itself when it is there but not executable to ``user``, or None when ``user`` can run it. Asked as
    ``user`` (``runuser``), so ACLs and groups count as the kernel counts them."""
    path = Path(os.path.abspath(path))
    steps = [*reversed(path.parents), path]
    script = 'for d in "$@"; do test -x "$d" || { printf %s "$d"; exit 1; }; done'
    proc = subprocess.run(["runuser", "-u", user, "--", "sh", "-c", script, "sh", *map(str, steps)],
                          capture_output=True, text=True)
    return Path(proc.stdout) if proc.returncode and proc.stdout else None


def closed_folders(path: str | os.PathLike[str], user: str) -> list[Path]:
    """The folders on the way to ``path`` that keep ``user`` out, outermost first: the first one ``user``
    cannot pass (asked as ``user``), then those past it without search permission for others (as root sees
    their modes: ``user`` cannot look yet). Empty when ``user`` reaches ``path``."""
    folder = unreachable_folder(Path(path), user)
    if folder is None:
        return []
    below = [d for d in Path(os.path.abspath(path)).parents if folder in d.parents]
    return [folder, *(d for d in sorted(below, key=lambda d: len(d.parts))
                      if d.is_dir() and not d.stat().st_mode & 0o001)]


def checkout_out_of_reach(paths: Iterable[str | os.PathLike[str]], users: Iterable[str]) -> str | None:
    """One line saying which folder keeps one of ``users`` (the Slurm account, an ordinary job user) from
    ``paths`` (the virtualenv's python, the checkout its editable install imports from), which every hook,
    service and job of a test cluster runs, and the way out; None when all of them reach all. A clone in
    root's 0700 home otherwise fails dozens of tests, each as if the product were broken."""
    users = tuple(users)
    for path in paths:
        for user in users:
            closed = closed_folders(path, user)
            if closed:
                return (f"the Slurm tests cannot run from here: {user} cannot pass {closed[0]} to reach {path} "
                        f"(hooks, services and jobs run as {', '.join(users)}); clone into a folder every user "
                        f"can traverse (e.g. /srv or /opt) and run make there, or allow search only: "
                        f"chmod o+x {' '.join(map(str, closed))}")
    return None


#: Set inside the private mount namespace :func:`open_view_argv` makes (so a session re-run there does not
#: try again).
OPEN_VIEW_VAR = "GPUSHARE_TEST_OPEN_VIEW"


def open_view_argv(closed: Sequence[Path], keep: Sequence[Path], argv: Sequence[str]) -> list[str] | None:
    """``argv`` run in a private mount namespace in which the ``closed`` folders (outermost first, all below
    the first) are searchable by every user, while on disk they keep their modes: an overlay is mounted over
    the outermost (its upper layer in a scratch folder under /tmp, with the folder's owner and mode), the
    folders get ``go+x`` there (group too: a test that drops only its uid to ``nobody`` keeps root's group, and
    for it the group bits decide), and each of ``keep`` (the checkout, a virtualenv below the same folder) is the
    real folder again, bound back over the overlay, so what the session writes there lands on disk. Daemons,
    hooks and jobs the session starts inherit the namespace. None where this cannot be done (a path that an
    overlay option cannot carry, closed folders in two trees)."""
    top = Path(closed[0])
    if any(top != c and top not in Path(c).parents for c in closed) or any(
            ch in str(p) for p in (top, *keep) for ch in ",:"):
        return None
    q = shlex.quote
    keep = sorted({Path(k) for k in keep if top in Path(k).parents}, key=lambda k: len(k.parts))
    keep = [k for n, k in enumerate(keep) if not any(o in k.parents for o in keep[:n])]  # one bind carries both
    setup = ['mkdir "$stash/upper" "$stash/work"',
             f'chown --reference={q(str(top))} "$stash/upper"', f'chmod --reference={q(str(top))} "$stash/upper"']
    for n, k in enumerate(keep):
        setup += [f'mkdir "$stash/keep{n}"', f'mount --bind {q(str(k))} "$stash/keep{n}"']
    setup.append(f'mount -t overlay overlay -o "lowerdir={top},upperdir=$stash/upper,workdir=$stash/work" {q(str(top))}')
    setup.append("chmod go+x " + " ".join(q(str(c)) for c in closed))
    setup += [f'mount --bind "$stash/keep{n}" {q(str(k))}' for n, k in enumerate(keep)]
    # mounts are the namespace's, so the subshell's stay; where one fails the command still runs and says why
    lines = ["stash=$(mktemp -d /tmp/gpushare-open-view-XXXXXX) || exit 1",
             "( set -e; " + "; ".join(setup) + " ) || echo 'could not open the folders on the way to the checkout in a "
             "private mount namespace' >&2",
             '"$@"', "rc=$?",
             "umount -l " + " ".join([*(q(str(k)) for k in reversed(keep)), q(str(top))]) + " 2>/dev/null",
             # rmdir, never rm -r, on the mount points: one still mounted would be the real checkout
             'for d in "$stash"/keep*; do umount -l "$d" 2>/dev/null; rmdir "$d" 2>/dev/null; done',
             'rm -rf "$stash/upper" "$stash/work"; rmdir "$stash" 2>/dev/null', "exit $rc"]
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", "\n".join(lines), "sh", *argv]


def missing_requirements(version: str | None = None) -> str | None:
    """Why a local cluster of ``version`` (default: the requested one) cannot run here, or None."""
    version = version or requested_version()
    if version not in VERSIONS:
        return f"unknown Slurm version {version!r} in {ENV_VAR} (use one of {', '.join(VERSIONS)})"
    if os.geteuid() != 0:
        return "needs root (mknod for GPU device files, Slurm daemons started as root drop to SlurmUser)"
    if version == HOST:
        missing = [b for b in HOST_BINARIES if not shutil.which(b, path=_HOST_PATH)]
        if missing:
            return (f"Slurm/munge not installed (missing {', '.join(missing)}; apt-get install slurmctld slurmd "
                    "slurm-client munge lua-socket)")
        release = host_release()
        if chroot.major_minor(release) != HOST:
            return f"the host's Slurm is {release or 'unknown'}, not {HOST} (set {ENV_VAR} to a chroot version)"
        return None
    problem = chroot.missing_requirements(version)
    return f"Slurm {version}: {problem}" if problem else None


@dataclass(frozen=True)
class SlurmRuntime:
    """How to run Slurm ``version`` for one cluster: directly on the host, or through its chroot."""

    version: str
    release: str  # as slurmctld -V says, e.g. "24.11.5"
    root: Path | None = None  # the chroot; None on the host
    enter: Path | None = None  # the cluster's chroot-run script
    bin_dir: Path | None = None  # wrappers for the chroot's client tools

    @property
    def in_chroot(self) -> bool:
        return self.root is not None

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run where this Slurm lives (as root; the working directory is kept)."""
        return [str(self.enter), *argv] if self.enter else list(argv)

    def user_argv(self, user: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run as the ordinary ``user``; for a chroot the switch happens inside it."""
        if self.enter and self.root:
            chroot.sync_accounts(self.root)  # the user may have been created after the cluster started
            return [str(self.enter), "--user", user, *argv]
        return ["runuser", "-u", user, "--", *argv]


def prepare(version: str, base: Path, extra_binds: Iterable[str | os.PathLike[str]] = ()) -> SlurmRuntime:
    """The runtime for a cluster under ``base``: builds the chroot when needed and writes its scripts.

    ``extra_binds`` are host paths that must be visible inside the chroot at the same place (the
    repository with its virtualenv, the cluster's own directory when it is not under /tmp).
    """
    if version == HOST:
        return SlurmRuntime(version=HOST, release=host_release())
    root = chroot.ensure_chroot(version)
    binds = chroot.runtime_binds([base, *extra_binds])
    chroot.prepare_runtime(root, binds)
    enter = chroot.write_enter_script(base / "bin" / "chroot-run", root, binds,
                                      title=f"Runs a command inside the Slurm {version} chroot {root}")
    bin_dir = base / "slurmbin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(bin_dir, 0o755)
    for tool in chroot.client_tools(root):
        wrapper = bin_dir / os.path.basename(tool)
        wrapper.write_text(chroot.tool_wrapper(enter, tool))
        wrapper.chmod(0o755)
    stamp = chroot.read_stamp(root) or {}
    return SlurmRuntime(version=version, release=str(stamp.get("slurm", version)), root=root, enter=enter,
                        bin_dir=bin_dir)
