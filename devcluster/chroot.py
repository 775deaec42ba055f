"""Debian chroots that hold a newer Slurm release, built once per host and cached.

Why: Debian ships exactly one Slurm per release (22.05 in bookworm, 24.11 in trixie, 26.05 in sid), and a
Slurm client only talks to a controller of a nearby release. To run the real daemons *and* the client tools
of another Slurm release on this host, we install that Debian release into a directory with debootstrap and
run every Slurm process inside it. The host's Python interpreter and the project's virtualenv are bind-mounted
in at the same paths, so the project's hooks and services run unchanged (no second Python, no second torch).

Processes enter the chroot through a generated shell script (``chroot-run``, see :func:`enter_script`) that
first moves into a private mount namespace (``unshare --mount``): its bind mounts exist only for that process
tree and vanish with it, so nothing ever leaks onto the host's mount table.

Stdlib only and independent of the rest of the project, so it can be run by hand::

    python -m devcluster.chroot build 24.11
    python -m devcluster.chroot shell 26.05 [-- COMMAND ...]
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

#: Slurm release (major.minor) → the Debian suite that ships it.
SUITES: dict[str, str] = {"24.11": "trixie", "26.05": "sid"}
#: What the local clusters need: daemons (slurmdbd for clusters with accounting, devcluster.accounting), client
#: tools, munge, Lua 5.1 for job_submit/lua, and Lmod (batch scripts that `module load` their environment,
#: replayed by asynchronous estimation on the node).
PACKAGES: tuple[str, ...] = ("slurmctld", "slurmd", "slurm-client", "slurmdbd", "munge", "lua5.1", "lua-socket",
                             "lmod")
#: Client tools that get a wrapper on the host (those present in the chroot).
CLIENT_TOOLS: tuple[str, ...] = ("sbatch", "scontrol", "squeue", "sinfo", "scancel", "srun", "salloc", "sacct",
                                 "sacctmgr", "sattach", "sprio", "sshare", "sstat", "sdiag", "strigger", "sbcast", "scrontab")
#: Bumped whenever the build recipe changes, so older cached chroots are rebuilt rather than trusted.
BUILD_FORMAT = 3
DEFAULT_CACHE = Path("/var/cache/gpushare/slurm-chroots")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
STAMP_NAME = ".gpushare-chroot.json"  # at the chroot's top, outside what the chroot sees as /etc
MARKER = "etc/gpushare-slurm-chroot"  # inside: lets wrapper scripts know they already run in the chroot
HOST_LIB_DIR = "usr/local/lib/gpushare-host"  # host libraries the host interpreter needs, absent in the chroot
LIB_DIRS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib64", "usr/lib64", "lib", "usr/lib",
            "usr/local/lib", HOST_LIB_DIR)
ACCOUNT_FILES = ("passwd", "group", "shadow", "gshadow", "hosts")
# Build-time only: run a command in the chroot with /proc, /dev and /sys, in a private mount namespace.
# A constant script; the chroot path and the command arrive as positional arguments.
_NS_CHROOT = ('r=$1; shift; mount -t proc proc "$r/proc" && mount --rbind /dev "$r/dev" && '
              'mount --rbind /sys "$r/sys" && exec chroot "$r" "$@"')
_SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ChrootError(RuntimeError):
    """A chroot cannot be built or used; the message is one line meant for a person."""


# --- where things are ----------------------------------------------------------------------------------
def cache_dir() -> Path:
    """Where chroots live: ``$GPUSHARE_CHROOT_DIR`` or /var/cache/gpushare/slurm-chroots."""
    return Path(os.environ.get("GPUSHARE_CHROOT_DIR") or DEFAULT_CACHE)


def mirror() -> str:
    return os.environ.get("GPUSHARE_DEBIAN_MIRROR") or DEFAULT_MIRROR


def suite_for(version: str) -> str:
    try:
        return SUITES[version]
    except KeyError:
        known = ", ".join(sorted(SUITES))
        raise ChrootError(f"no chroot recipe for Slurm {version!r} (known: {known})") from None


def chroot_path(version: str) -> Path:
    suite_for(version)
    return cache_dir() / version


def read_stamp(root: Path) -> dict | None:
    """The build record of a finished chroot, or None when it is missing, half-built or from another recipe."""
    try:
        stamp = json.loads((root / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict) or stamp.get("format") != BUILD_FORMAT:
        return None
    return stamp


def major_minor(release: str) -> str:
    """``"24.11.5"`` → ``"24.11"``."""
    match = re.match(r"(\d+)\.(\d+)", release)
    return f"{match.group(1)}.{match.group(2)}" if match else release


def is_ready(version: str) -> bool:
    root = chroot_path(version)
    stamp = read_stamp(root)
    return bool(stamp) and major_minor(str(stamp.get("slurm", ""))) == version


# --- requirements ---------------------------------------------------------------------------------------
def missing_requirements(version: str) -> str | None:
    """Why a chroot for ``version`` can neither be used nor built here, or None.

    Cheap enough for a pytest skip check: a ready chroot answers from its stamp; otherwise we check the tools
    and that the Debian mirror answers on its port (no download).
    """
    if version not in SUITES:
        return f"no chroot recipe for Slurm {version} (known: {', '.join(sorted(SUITES))})"
    if sys.platform != "linux":
        return "Slurm chroots need Linux"
    if os.geteuid() != 0:
        return "Slurm chroots need root (debootstrap, chroot, mount namespaces)"
    if platform.machine() != "x86_64":
        return f"Slurm chroots are built for x86_64 only (this is {platform.machine()})"
    for tool in ("unshare", "chroot", "mount"):
        if not shutil.which(tool, path=_SAFE_PATH):
            return f"{tool} not found (util-linux/coreutils)"
    if is_ready(version):
        return None
    reachable = _mirror_reachable()
    if not reachable:
        return (f"no Slurm {version} chroot in {cache_dir()} and Debian's mirror {mirror()} is unreachable "
                f"(build one elsewhere and copy it, or set GPUSHARE_CHROOT_DIR)")
    if not shutil.which("debootstrap", path=_SAFE_PATH) and not shutil.which("apt-get", path=_SAFE_PATH):
        return "debootstrap is not installed and apt-get is unavailable to install it"
    return None


def _mirror_reachable(timeout_s: float = 5.0) -> bool:
    parts = urlsplit(mirror())
    if parts.scheme == "file":
        return Path(parts.path).is_dir()
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=timeout_s):
            return True
    except OSError:
        return False


# --- building -------------------------------------------------------------------------------------------
@contextmanager
def _locked(version: str) -> Iterator[None]:
    """One builder per version across processes: concurrent test runs wait instead of building twice."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_chroot(version: str, log: Path | None = None) -> Path:
    """The path of a ready chroot holding Slurm ``version``; builds it first when the cache has none.

    The build happens in a temporary directory beside the cache entry and is renamed into place only after
    the Slurm release was verified, so a crashed or interrupted build is never used (it is removed by the
    next builder). ``log`` receives debootstrap/apt output (default: a file next to the cache entry).
    """
    problem = missing_requirements(version)
    if problem:
        raise ChrootError(problem)
    root = chroot_path(version)
    if is_ready(version):
        return root
    with _locked(version):
        if is_ready(version):  # another process built it while we waited
            return root
        _remove_leftovers(version)
        log = log or cache_dir() / f"{version}.build.log"
        build = Path(tempfile.mkdtemp(prefix=f".build-{version}-", dir=cache_dir()))
        os.chmod(build, 0o755)  # it becomes the chroot's /, which ordinary users must traverse
        try:
            _build(version, build, log)
        except BaseException:
            _remove_tree(build)
            raise
        if root.exists() or root.is_symlink():  # a broken entry (no valid stamp): set aside, then delete
            broken = Path(tempfile.mkdtemp(prefix=f".broken-{version}-", dir=cache_dir()))
            os.rename(root, broken / "old")
            _remove_tree(broken)
        os.rename(build, root)
    return root


def _remove_leftovers(version: str) -> None:
    for leftover in cache_dir().glob(f".build-{version}-*"):
        _remove_tree(leftover)
    for leftover in cache_dir().glob(f".broken-{version}-*"):
        _remove_tree(leftover)


def _remove_tree(path: Path) -> None:
    """rm -r that refuses when anything is mounted below ``path`` (it would delete the host's files)."""
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as info:
        for line in info:
            mount_point = line.split()[4].replace("\\040", " ")
            if mount_point == real or mount_point.startswith(real + "/"):
                raise ChrootError(f"refusing to delete {path}: {mount_point} is mounted inside it")
    shutil.rmtree(path, ignore_errors=True)


def _build(version: str, target: Path, log: Path) -> None:
    suite = suite_for(version)
    started = time.monotonic()
    _ensure_debootstrap(log)
    with open(log, "a") as out:
        out.write(f"\n=== {datetime.datetime.now().isoformat(timespec='seconds')} building Slurm {version} "
                  f"({suite}) in {target}\n")
    # debootstrap mounts /proc and /sys in the target; a private namespace guarantees they go away with it.
    _logged(["unshare", "--mount", "--propagation", "private", "--", "debootstrap", "--variant=minbase",
             "--arch=amd64", suite, str(target), mirror()], log, f"debootstrap {suite}")
    base_s = time.monotonic() - started
    _configure_apt(target)
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": _SAFE_PATH, "LANG": "C.UTF-8", "HOME": "/root"}
    _logged(ns_argv(target, ["apt-get", "update", "-q"]), log, "apt-get update", env=env)
    _logged(ns_argv(target, ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]), log,
            "apt-get install", env=env)
    _logged(ns_argv(target, ["apt-get", "clean"]), log, "apt-get clean", env=env)
    release = slurm_release(target)
    if major_minor(release) != version:
        raise ChrootError(f"Debian {suite} now ships Slurm {release}, not {version}: "
                          f"update devcluster.chroot.SUITES")
    (target / MARKER).write_text(f"{version}\n")
    stamp = {"format": BUILD_FORMAT, "requested": version, "slurm": release, "suite": suite, "mirror": mirror(),
             "built": datetime.datetime.now().isoformat(timespec="seconds"),
             "debootstrap_s": round(base_s, 1), "total_s": round(time.monotonic() - started, 1)}
    tmp = target / (STAMP_NAME + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=1) + "\n")
    os.rename(tmp, target / STAMP_NAME)


def _ensure_debootstrap(log: Path) -> None:
    if shutil.which("debootstrap", path=_SAFE_PATH):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _logged(["apt-get", "update", "-q"], log, "apt-get update (host)", env=env)
    _logged(["apt-get", "install", "-y", "-q", "--no-install-recommends", "debootstrap"], log,
            "apt-get install debootstrap", env=env)


def _configure_apt(target: Path) -> None:
    """Package installs must start no services, tolerate sid's sometimes-expired Release file, stay small."""
    policy = target / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\n# No service starts inside this chroot: its daemons are started on demand.\n"
                      "exit 101\n")
    policy.chmod(0o755)
    (target / "etc/apt/apt.conf.d/90gpushare").write_text(
        'Acquire::Check-Valid-Until "false";\nAPT::Install-Recommends "false";\n'
        'APT::Install-Suggests "false";\nAcquire::Languages "none";\n')
    (target / "etc/dpkg/dpkg.cfg.d/90gpushare-nodoc").write_text(
        "path-exclude=/usr/share/doc/*\npath-include=/usr/share/doc/*/copyright\n"
        "path-exclude=/usr/share/man/*\npath-exclude=/usr/share/info/*\npath-exclude=/usr/share/locale/*\n")


def _logged(argv: list[str], log: Path, what: str, env: dict[str, str] | None = None) -> None:
    with open(log, "a") as out:
        out.write(f"--- {what}: {shlex.join(argv)}\n")
        out.flush()
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        raise ChrootError(f"{what} failed (exit {proc.returncode}); see {log}: {tail}")


def ns_argv(root: Path, argv: Sequence[str]) -> list[str]:
    """argv running ``argv`` as root inside ``root`` with /proc, /dev, /sys only (building, probing)."""
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", _NS_CHROOT, "sh", str(root),
            *argv]


def slurm_release(root: Path) -> str:
    """The Slurm release installed in ``root`` as ``slurmctld -V`` prints it (``"24.11.5"``)."""
    proc = subprocess.run(ns_argv(root, ["/usr/sbin/slurmctld", "-V"]), capture_output=True, text=True,
                          env={"PATH": _SAFE_PATH})
    match = re.search(r"slurm(?:-wlm)?\s+(\d+\.\d+\.\S+)", proc.stdout + proc.stderr)
    if proc.returncode != 0 or not match:
        raise ChrootError(f"slurmctld -V failed in {root}: {(proc.stdout + proc.stderr).strip()[:200]}")
    return match.group(1)


# --- running things inside ------------------------------------------------------------------------------
def interpreter_chain(executable: str | None = None) -> tuple[list[tuple[str, str]], str]:
    """The symlinks from the base interpreter to its real file, and that file.

    Starts from the running interpreter: a virtualenv's ``bin/python3`` points at e.g. /usr/bin/python3 →
    python3.11; the links outside bound paths must exist in the chroot too, and the final file is
    bind-mounted over an empty placeholder there.
    """
    path = os.path.abspath(executable or sys.executable)
    links: list[tuple[str, str]] = []
    for _ in range(40):
        if not os.path.islink(path):
            break
        target = os.readlink(path)
        links.append((path, target))
        path = os.path.normpath(os.path.join(os.path.dirname(path), target))
    return links, os.path.realpath(path)


def runtime_binds(extra: Iterable[str | os.PathLike[str]] = ()) -> list[str]:
    """Host directories and files seen at the same path inside the chroot.

    /tmp (clusters' scratch directories, pytest's tmp_path), the host interpreter with its standard library,
    the running virtualenv, and ``extra`` (the repository). Paths below another bound path are dropped.
    """
    _, interpreter = interpreter_chain()
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = ["/tmp", interpreter, os.path.join(sys.base_prefix, "lib", version), f"/etc/{version}"]
    if sys.prefix != sys.base_prefix:
        candidates.append(sys.prefix)
    candidates.extend(os.fspath(p) for p in extra)
    kept: list[str] = []
    for path in sorted({os.path.realpath(p) for p in candidates if os.path.exists(p)}, key=len):
        if path != "/" and not any(path == k or path.startswith(k + "/") for k in kept):
            kept.append(path)
    return kept


def prepare_runtime(root: Path, binds: Sequence[str]) -> None:
    """Make ``root`` ready for :func:`enter_script` with ``binds``: mount points, interpreter, libraries, users.

    Idempotent and cheap; run before starting a cluster. Only adds empty mount points, the interpreter's
    symlinks and missing shared libraries to the cached chroot, nothing the next build would miss. Holds the
    version's build lock, so concurrent test processes never race on the same files.
    """
    with _locked(root.name):
        _prepare_locked(root, binds)


def _prepare_locked(root: Path, binds: Sequence[str]) -> None:
    for path in binds:
        inside = root / path.lstrip("/")
        if os.path.isdir(path):
            inside.mkdir(parents=True, exist_ok=True)
        elif not inside.exists():
            inside.parent.mkdir(parents=True, exist_ok=True)
            inside.touch()
        # slurm and the jobs' users must pass the chroot's own folders on the way to a bind (a checkout under
        # /root meets the chroot's 0700 /root): search permission only, inside the chroot, which is ours
        for folder in inside.parents:
            if folder == root or root not in folder.parents:
                continue
            mode = folder.stat().st_mode
            if not mode & 0o001:
                folder.chmod((mode & 0o7777) | 0o011)
    links, _ = interpreter_chain()
    for link, target in links:
        inside = root / link.lstrip("/")
        if not _under(link, binds) and not os.path.lexists(inside):
            inside.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(target, inside)
    _copy_missing_libraries(root)
    sync_accounts(root)


def _under(path: str, binds: Sequence[str]) -> bool:
    return any(path == b or path.startswith(b.rstrip("/") + "/") for b in binds)


def _copy_missing_libraries(root: Path) -> None:
    """Shared libraries the host interpreter (and its extension modules) link that the chroot lacks.

    Newer Debian releases rename library packages (t64, soname bumps), so we copy the host's files by soname
    into a directory of their own; ldconfig runs only when something was added.
    """
    stamp = root / HOST_LIB_DIR / ".interpreter"
    _, interpreter = interpreter_chain()
    try:
        identity = f"{interpreter} {os.stat(interpreter).st_mtime_ns}\n"
    except OSError:
        return
    if stamp.exists() and stamp.read_text() == identity:
        return
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    objects = [interpreter, *map(str, Path(sys.base_prefix, "lib", version, "lib-dynload").glob("*.so"))]
    needed: dict[str, str] = {}
    for chunk in range(0, len(objects), 64):
        proc = subprocess.run(["ldd", *objects[chunk:chunk + 64]], capture_output=True, text=True)
        for soname, path in re.findall(r"^\s*(\S+) => (/\S+)", proc.stdout, flags=re.M):
            needed.setdefault(soname, path)
    target = root / HOST_LIB_DIR
    target.mkdir(parents=True, exist_ok=True)
    added = False
    for soname, path in sorted(needed.items()):
        if any(os.path.lexists(root / d / soname) for d in LIB_DIRS):  # links there may be absolute
            continue
        shutil.copy2(path, target / soname)
        added = True
    conf = root / "etc/ld.so.conf.d/gpushare-host.conf"
    if added or not conf.exists():
        conf.write_text(f"/{HOST_LIB_DIR}\n")
        subprocess.run(ns_argv(root, ["/sbin/ldconfig"]), check=False, capture_output=True,
                       env={"PATH": _SAFE_PATH})
    stamp.write_text(identity)


def sync_accounts(root: Path) -> None:
    """Copy the host's users, groups and /etc/hosts into the chroot when they differ.

    Copied, not bind-mounted: useradd replaces /etc/passwd with a new file, which a bind mount of the old one
    would never show. Each file is replaced atomically so a daemon reading it never sees half a file.
    """
    for name in ACCOUNT_FILES:
        source = Path("/etc") / name
        inside = root / "etc" / name
        try:
            data = source.read_bytes()
        except FileNotFoundError:
            continue
        try:
            if inside.read_bytes() == data:
                continue
        except FileNotFoundError:
            pass
        tmp = inside.with_name(f".{name}.gpushare-{os.getpid()}")
        tmp.write_bytes(data)
        shutil.copystat(source, tmp)
        os.chown(tmp, os.stat(source).st_uid, os.stat(source).st_gid)
        os.rename(tmp, inside)


def enter_script(root: Path, binds: Sequence[str], title: str = "") -> str:
    """A shell script running its arguments inside ``root`` (``[--user NAME] COMMAND [ARG...]``).

    It re-executes itself under ``unshare --mount`` (a private mount namespace), mounts /proc, /sys, /dev and
    ``binds`` at their own paths, also binds the caller's working directory when it is not visible inside,
    then chroots there and returns to that directory (GNU chroot would start in /), optionally as another
    user. Only our own paths are written into it, each quoted.
    """
    q = shlex.quote
    mounts = "\n".join(f'mount --rbind {q(p)} "$root"{q(p)}' for p in binds)
    visible = "|".join(f"{q(p)}|{q(p)}/*" for p in binds)
    return f"""#!/bin/sh
# {title or 'Runs a command inside ' + str(root)} (generated by devcluster.chroot).
# Usage: chroot-run [--user NAME] COMMAND [ARG...]
if [ "${{1-}}" != --in-namespace ]; then
  exec unshare --mount --propagation private -- "$0" --in-namespace "$@"
fi
shift
set -e
root={q(str(root))}
user=
if [ "${{1-}}" = --user ]; then user=$2; shift 2; fi
mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"
{mounts}
cwd=$(pwd -P 2>/dev/null) || cwd=/
case "$cwd" in
  /|{visible}) ;;
  *) mkdir -p "$root$cwd"; mount --bind "$cwd" "$root$cwd" ;;
esac
if [ -n "$user" ]; then
  exec chroot "$root" /bin/sh -c 'cd "$1" && u=$2 && shift 2 && exec runuser -u "$u" -- "$@"' sh "$cwd" "$user" "$@"
fi
exec chroot "$root" /bin/sh -c 'cd "$1" && shift && exec "$@"' sh "$cwd" "$@"
"""


def tool_wrapper(enter: Path, tool_path: str) -> str:
    """A host-side stand-in for one of the chroot's tools (``sbatch`` …).

    Inside the chroot (the marker file exists, e.g. gpushare-submitd calling sbatch) it runs the tool
    directly; on the host it enters the chroot first.
    """
    q = shlex.quote
    return (f"#!/bin/sh\n# Runs the chroot's {os.path.basename(tool_path)} (generated by devcluster.chroot).\n"
            f"if [ -e /{MARKER} ]; then exec {q(tool_path)} \"$@\"; fi\n"
            f"exec {q(str(enter))} {q(tool_path)} \"$@\"\n")


def write_enter_script(path: Path, root: Path, binds: Sequence[str], title: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(enter_script(root, binds, title))
    tmp.chmod(0o755)
    os.rename(tmp, path)
    return path


def client_tools(root: Path) -> list[str]:
    """Absolute in-chroot paths of the Slurm client tools installed in ``root``."""
    return [f"/usr/bin/{t}" for t in CLIENT_TOOLS if (root / "usr/bin" / t).exists()]


# --- command line ---------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devcluster.chroot",
                                     description="Build and enter cached Debian chroots holding newer Slurm.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build (once) the chroot for a Slurm version and print its path")
    build.add_argument("version", choices=sorted(SUITES))
    shell = sub.add_parser("shell", help="run a shell (or COMMAND) inside the chroot, /tmp and this venv bound")
    shell.add_argument("version", choices=sorted(SUITES))
    shell.add_argument("--user", help="run as this user (switched inside the chroot)")
    shell.add_argument("cmd", nargs="*", help="COMMAND [ARG...] after --  (default: bash)")
    check = sub.add_parser("check", help="say why a version cannot run here (exit 1), or print its stamp")
    check.add_argument("version", choices=sorted(SUITES))
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    try:
        if args.command == "check":
            problem = missing_requirements(args.version)
            if problem:
                print(problem, file=sys.stderr)
                return 1
            print(json.dumps(read_stamp(chroot_path(args.version)) or {"ready": False}))
            return 0
        started = time.monotonic()
        root = ensure_chroot(args.version)
        if args.command == "build":
            stamp = read_stamp(root) or {}
            print(f"{root}  Slurm {stamp.get('slurm')} ({stamp.get('suite')}), ready in "
                  f"{time.monotonic() - started:.1f} s")
            return 0
        binds = runtime_binds()
        prepare_runtime(root, binds)
        with tempfile.TemporaryDirectory(prefix="gpushare-chroot-") as tmp:
            enter = write_enter_script(Path(tmp) / "chroot-run", root, binds)
            cmd = [*args.cmd, *command] or ["/bin/bash"]
            user = ["--user", args.user] if args.user else []
            return subprocess.run([str(enter), *user, *cmd]).returncode
    except ChrootError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
