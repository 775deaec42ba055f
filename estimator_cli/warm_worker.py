"""A per-user warm worker: an interpreter with torch already imported that forks one capture child per
estimate, so an estimate does not pay torch's import (2–3 s of a 2-core login node's time) every time.

Why a fork server: the capture must run in a process of its own (estimator_cli/runner.py says why), and
most of a cold child's time is ``import torch`` plus the lazy imports of the first meta kernels (sympy,
``torch._refs``). Forking a process that has done them costs milliseconds, and the child is exactly the
cold child minus the import: it gets the caller's argv, environment, working directory and limits, runs
in its own session (so a timeout kills its whole process group) and writes the same result file.

Safety and identity:
- The worker is the invoking user's own process, started by their ``gpu-estimate``; nothing runs as
  anyone else. Its socket lives in a directory only the user can enter (``$XDG_RUNTIME_DIR/gpushare``,
  else ``/tmp/gpushare-<uid>``, created 0700 and checked to be theirs and private), and it serves only
  connections whose peer uid is its own.
- One worker per *import environment*: the socket name carries a fingerprint of what ``import torch``
  depends on (the interpreter as invoked and the environment's prefix, the installed distributions on
  ``sys.path``, PYTHONPATH, the torch/OpenMP/CUDA variables, this package's source files), so another
  virtual environment, an upgraded torch or gpushare, or a changed environment gets a fresh worker
  instead of a stale one.
- It exits after ``[estimator] warm_worker_idle_s`` without a request (0 turns warm workers off).

Protocol (one JSON line each way on a Unix stream socket): ``{"op": "hello"}`` → ``{"ok": true, ...}``;
``{"op": "run", "argv": [...], "env": {...}, "cwd": ..., "log": ...}`` → ``{"pid": N}`` then, when the
child ends, ``{"status": S}`` with S as ``subprocess.Popen.returncode`` (negative: killed by a signal).
A supervisor process sits between the worker and the child: it reports the status, and kills the child's
process group if the caller goes away.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

from gpushare.errors import GpushareError

PROTOCOL = 1
_IMPORT_ENV_PREFIXES = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "CUDA", "NVIDIA", "GOMP", "ATEN")
_IMPORT_ENV_KEYS = ("PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONUSERBASE",
                    "LD_LIBRARY_PATH", "LD_PRELOAD", "HOME", "VIRTUAL_ENV")
_PRELOAD = ("torch", "torch.optim", "torch.utils.data", "torch._refs", "torch._prims", "torch._decomp",
            "torch._meta_registrations", "torch.fx.experimental.symbolic_shapes", "torch.nn.functional",
            "gpushare.estimator_cli.runner", "gpushare.estimator_cli.capture", "gpushare.estimator_cli.profile_capture")


class WarmUnavailable(GpushareError):
    """No warm worker can be used; the caller starts a cold child (the reason is for --verbose)."""


# -- where and which ---------------------------------------------------------------------------------
def fingerprint(env: Mapping[str, str] | None = None) -> str:
    """What a forked child inherits from the worker's start and a cold child would read afresh."""
    env = os.environ if env is None else env
    package = Path(__file__).resolve().parent
    sources = sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size)
                     for d in (package, package.parent / "gpushare") for p in d.glob("*.py"))
    relevant = sorted((k, v) for k, v in env.items()
                      if k in _IMPORT_ENV_KEYS or k.startswith(_IMPORT_ENV_PREFIXES))
    blob = json.dumps([PROTOCOL, sys.executable, os.path.realpath(sys.executable), sys.prefix, sys.base_prefix,
                       sys.version, str(package), sources, relevant, installed_distributions()])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def installed_distributions() -> list[tuple[str, str, int]]:
    """(directory, entry, mtime) of every installed distribution's metadata directory and ``.pth`` file on
    ``sys.path``.

    Why: every virtual environment made from one Python resolves to the same interpreter, so the
    interpreter path alone let one venv's ``gpu-estimate`` run scripts in another venv's worker (missing
    packages); and a package upgraded in place (``pip install -U torch``) must retire a worker that has the
    old version imported. Installing, removing or upgrading a distribution renames or rewrites its
    ``*.dist-info`` directory, which changes this list; listing a few directories costs well under 1 ms.
    """
    entries: list[tuple[str, str, int]] = []
    for directory in dict.fromkeys(p for p in sys.path if p and os.path.isdir(p)):
        try:
            with os.scandir(directory) as it:
                for entry in it:
                    if entry.name.endswith((".dist-info", ".egg-info", ".pth", ".egg-link")):
                        entries.append((directory, entry.name, entry.stat().st_mtime_ns))
        except OSError:
            continue
    return sorted(entries)


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """The user's private directory for worker sockets, created if needed; raises WarmUnavailable when it
    exists but is not private to this user (someone could then impersonate the worker)."""
    env = os.environ if env is None else env
    uid = os.geteuid()
    xdg = env.get("XDG_RUNTIME_DIR", "")
    base = Path(xdg) / "gpushare" if xdg and _private_dir(Path(xdg), uid) else Path(f"/tmp/gpushare-{uid}")
    try:
        base.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise WarmUnavailable(f"cannot create {base}: {exc.strerror}") from None
    if not _private_dir(base, uid):
        raise WarmUnavailable(f"{base} is not a directory private to uid {uid}; warm worker not used")
    return base


def _private_dir(path: Path, uid: int) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == uid and not info.st_mode & 0o077


def socket_path(env: Mapping[str, str] | None = None) -> Path:
    return runtime_dir(env) / f"estimate-{fingerprint(env)}.sock"


# -- the caller's side ----------------------------------------------------------------------------------
def _connect(path: Path, timeout_s: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    return sock


def _request(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall((json.dumps(message) + "\n").encode())


def _read_line(sock: socket.socket) -> dict[str, Any] | None:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            return None
        data += chunk
    reply = json.loads(data)
    return reply if isinstance(reply, dict) else None


def _hello(path: Path) -> dict[str, Any] | None:
    """The worker's greeting (its pid and protocol), or None when nothing usable answers."""
    try:
        with _connect(path, 2.0) as sock:
            _request(sock, {"op": "hello"})
            reply = _read_line(sock)
    except (OSError, ValueError):
        return None
    return reply if reply and reply.get("ok") and reply.get("protocol") == PROTOCOL else None


@contextlib.contextmanager
def private_runtime(prefix: str = "gpushare-runtime-") -> Iterator[Path]:
    """Run with ``XDG_RUNTIME_DIR`` at a fresh private directory, and stop the workers started there on
    the way out: tests and benchmarks get workers of their own and leave none behind."""
    runtime = Path(tempfile.mkdtemp(prefix=prefix))
    saved = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)
    try:
        yield runtime / "gpushare"
    finally:
        if (runtime / "gpushare").is_dir():
            stop_workers(runtime / "gpushare")
        if saved is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = saved
        shutil.rmtree(runtime, ignore_errors=True)


def stop_workers(directory: Path) -> int:
    """Stop the workers whose sockets are in ``directory`` (the user's runtime dir); returns how many.
    A worker exits by itself when idle; this is for tests and for ending one at once."""
    stopped = 0
    for path in directory.glob("estimate-*.sock"):
        hello = _hello(path)
        if hello and isinstance(hello.get("pid"), int):
            try:
                os.kill(hello["pid"], signal.SIGTERM)
                stopped += 1
            except OSError:
                pass
    return stopped


def ensure_worker(idle_s: float, wait_s: float) -> Path:
    """The socket of a live worker for this environment, starting one (detached) when there is none.
    Starting costs what a cold child would have spent importing torch, so the first estimate is not
    slower and the next ones are fast. Raises WarmUnavailable when none answers within ``wait_s``."""
    path = socket_path()
    if _hello(path):
        return path
    deadline = time.monotonic() + wait_s
    lock = path.with_suffix(".lock")
    for _ in range(2):  # a second start covers a worker that was exiting (idle) as we started ours
        subprocess.run([sys.executable, "-m", "gpushare.estimator_cli.warm_worker", "--socket", str(path),
                        "--idle", f"{idle_s:g}", "--daemonize"], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, cwd="/", timeout=60)
        # the start returns once a worker holds the lock: ours, or one that was there already
        while time.monotonic() < deadline:
            if _hello(path):
                return path
            if not _locked(lock):
                break  # no worker holds it any more: start again (once)
            time.sleep(0.05)
        else:
            raise WarmUnavailable(f"no warm worker answered within {wait_s:.0f} s")
    raise WarmUnavailable("the warm worker exited while starting")


def _locked(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


class WarmChild:
    """A capture child forked by the worker, with the parts of ``subprocess.Popen`` the launcher uses:
    ``pid`` (also its process group), ``poll()``, ``wait()`` and ``returncode``."""

    def __init__(self, path: Path, argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
        self.path = path  # the worker's socket: its learned preloads live beside it (preload.py)
        self._sock = _connect(path, 10.0)
        _request(self._sock, {"op": "run", "argv": argv, "env": env, "cwd": cwd, "log": log})
        reply = _read_line(self._sock)
        if not reply or not isinstance(reply.get("pid"), int):
            self._sock.close()
            raise WarmUnavailable(f"the warm worker refused the run: {(reply or {}).get('error', 'no reply')}")
        self.pid: int = reply["pid"]
        self.returncode: int | None = None
        self._buffer = b""

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(block=False)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("warm capture child", timeout or 0)
            self._read(block=True)
        return self.returncode

    def _read(self, block: bool) -> None:
        ready, _, _ = select.select([self._sock], [], [], 0.5 if block else 0)
        if not ready:
            return
        chunk = self._sock.recv(4096)
        if not chunk:  # the supervisor died without a word: treat like a killed child
            self._finish(-signal.SIGKILL)
            return
        self._buffer += chunk
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if isinstance(message, dict) and isinstance(message.get("status"), int):
                self._finish(message["status"])

    def _finish(self, status: int) -> None:
        self.returncode = status
        self._sock.close()


# -- the worker's side ----------------------------------------------------------------------------------
def _peer_uid(conn: socket.socket) -> int:
    import struct

    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _run_child(request: dict[str, Any]) -> None:
    """In the grandchild: become the cold child's twin, then run the capture (never returns)."""
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in request["env"].items()})
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # as PYTHONUNBUFFERED=1
        import random

        random.seed()  # forked children would otherwise share the worker's Python RNG state
        from gpushare.estimator_cli import runner

        code = runner.main([str(a) for a in request["argv"]])
    except BaseException as exc:  # noqa: BLE001 - whatever happens, say it where the caller reads it
        try:
            os.write(2, f"gpu-estimate warm worker: {type(exc).__name__}: {exc}\n".encode())
        finally:
            os._exit(1)
    os._exit(code if isinstance(code, int) else 0)


def _supervise(conn: socket.socket, request: dict[str, Any]) -> None:
    """In the child: fork the capture, report its pid and its end; kill it if the caller goes away."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run_child(request)
    caller_gone = False
    try:
        _request(conn, {"pid": pid})
    except OSError:
        caller_gone = True
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if caller_gone:
            _kill_group(pid)
            time.sleep(0.05)
            continue
        ready, _, _ = select.select([conn], [], [], 0.1)
        if ready:
            try:
                caller_gone = not conn.recv(1)
            except OSError:
                caller_gone = True
    try:
        _request(conn, {"status": os.waitstatus_to_exitcode(status)})
    except OSError:
        pass
    os._exit(0)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _handle(conn: socket.socket, inherited: tuple[int, ...]) -> None:
    conn.settimeout(5.0)
    if _peer_uid(conn) != os.geteuid():
        _request(conn, {"ok": False, "error": "permission denied: not your worker"})
        return
    request = _read_line(conn)
    if not request:
        return
    if request.get("op") == "hello":
        _request(conn, {"ok": True, "protocol": PROTOCOL, "pid": os.getpid()})
        return
    if request.get("op") != "run" or not all(k in request for k in ("argv", "env", "cwd", "log")):
        _request(conn, {"ok": False, "error": "bad request"})
        return
    if os.fork() == 0:
        for fd in inherited:  # the listener and the lock stay the worker's alone
            os.close(fd)
        _supervise(conn, request)


_WORKER_PID = [0]


def serve(path: Path, idle_s: float, ready_fd: int | None = None) -> int:
    _WORKER_PID[0] = os.getpid()
    lock_fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        _say_ready(ready_fd)
        return 0  # another worker for this environment is starting or serving
    _say_ready(ready_fd)
    import importlib

    for name in _PRELOAD:  # what every capture child would import first
        importlib.import_module(name)
    path.unlink(missing_ok=True)  # stale: we hold the lock, so no live worker owns it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(old_umask)
    listener.listen(64)
    inode = os.stat(path).st_ino
    last = time.monotonic()
    from gpushare.estimator_cli.preload import load_remembered

    preload_state: dict[str, int] = {}
    try:
        while time.monotonic() - last < idle_s:
            _reap()
            ready, _, _ = select.select([listener], [], [], min(1.0, idle_s))
            if not ready:
                load_remembered(path, preload_state)  # frameworks earlier scripts imported (preload.py)
                continue
            conn, _ = listener.accept()
            with conn:
                try:
                    _handle(conn, (listener.fileno(), lock_fd))
                except (OSError, ValueError):
                    pass
            last = time.monotonic()
    finally:
        try:
            if os.stat(path).st_ino == inode:
                path.unlink()
        except OSError:
            pass
        listener.close()
    return 0


def _daemonize() -> int:
    """Detach from the starting gpu-estimate (its session, terminal and streams). The starting process
    exits only once the worker holds its lock (or has seen another worker's), so the caller never
    mistakes a lock file left by an earlier, idle-exited worker for one that died while starting.
    Returns the pipe end on which the worker says so."""
    ready_read, ready_write = os.pipe()
    if os.fork() > 0:
        os.close(ready_write)
        select.select([ready_read], [], [], 30.0)
        os._exit(0)
    os.close(ready_read)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    return ready_write


def _say_ready(fd: int | None) -> None:
    if fd is not None:
        try:
            os.write(fd, b"1")
            os.close(fd)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpushare.estimator_cli.warm_worker")
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--idle", type=float, default=600.0)
    parser.add_argument("--daemonize", action="store_true")
    opts = parser.parse_args(argv)
    ready_fd = _daemonize() if opts.daemonize else None
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return serve(opts.socket, max(1.0, opts.idle), ready_fd)
    except _Terminated:
        return 0


class _Terminated(Exception):
    pass


def _terminate(signum: int, frame: Any) -> None:
    if os.getpid() == _WORKER_PID[0]:  # not in forked children, which reset it in _supervise
        raise _Terminated()


if __name__ == "__main__":
    sys.exit(main())
