"""The asynchronous-estimation loop in a process of its own, supervised by ``gpushare-submitd``.

Why not a thread of the submit service: each round parses ``squeue --json``; on a 30k-job queue that is
~1.3 s of CPU under the interpreter lock, during which submit answers stall past the shim's deadline.
As a separate process it shares nothing with the request path.

Lifecycle: submitd starts it (``python -m gpushare.slurm_plugins.estimation_process --parent PID``), forwards
SIGHUP (reload) and stops it with SIGTERM. The child asks the kernel for SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``) and holds an exclusive lock in the spool directory, so a submitd killed with
SIGKILL and restarted never leaves two loops submitting duplicate estimation jobs.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import click

from gpushare.logs import setup_logging
from gpushare.config import Config, ConfigError, load_config

log = logging.getLogger("gpushare.estimationd")
_PR_SET_PDEATHSIG = 1
# How long a new loop waits for the lock a killed submitd's loop still holds while it finishes its round
# (SIGTERM from PR_SET_PDEATHSIG): waiting here resumes estimation at once instead of after the
# supervisor's next 5 s restart.
LOCK_WAIT_S = 30.0


def _die_with_parent(parent: int) -> None:
    """SIGTERM when the parent dies; exit now if it already has (re-parented before we got here)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if parent and os.getppid() != parent:
        sys.exit(0)


def single_instance_lock(spool_dir: str) -> int | None:
    """An exclusive lock in the spool directory; None when another loop holds it."""
    Path(spool_dir).mkdir(mode=0o711, parents=True, exist_ok=True)  # users reach only their own directory
    fd = os.open(Path(spool_dir) / ".estimationd.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class Supervisor:
    """Keeps one estimation process alive beside submitd (restarted after a crash, at most every 5 s)."""

    def __init__(self, config_path: str | None) -> None:
        self.config_path = config_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gpushare-estimation-supervisor", daemon=True)

    def start(self) -> "Supervisor":
        self._spawn()
        self._thread.start()
        return self

    def _spawn(self) -> None:
        argv = [sys.executable, "-m", "gpushare.slurm_plugins.estimation_process", "--parent", str(os.getpid())]
        if self.config_path:
            argv += ["--config", self.config_path]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, close_fds=True)

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            if self.proc is not None and self.proc.poll() is not None:
                log.error("estimation process exited with %s; restarting it", self.proc.returncode)
                if self._stop.wait(5.0):
                    return
                self._spawn()

    def reload(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        self._stop.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def run_loop(cfg: Config, config_path: str | None) -> int:
    from gpushare.slurm_plugins.estimationd import EstimationService

    lock = single_instance_lock(cfg.estimation.spool_dir)
    deadline = time.monotonic() + LOCK_WAIT_S
    while lock is None and time.monotonic() < deadline:  # a killed submitd's loop ends its round first
        time.sleep(0.2)
        lock = single_instance_lock(cfg.estimation.spool_dir)
    if lock is None:
        log.error("another estimation loop holds %s/.estimationd.lock; not starting a second",
                  cfg.estimation.spool_dir)
        return 0
    service = EstimationService(cfg)
    stop = threading.Event()

    def _reload(signum: int, frame: object) -> None:
        try:
            service.cfg = load_config(config_path)
            log.warning("estimation: configuration reloaded")
        except ConfigError as exc:
            log.error("estimation: configuration not reloaded: %s", exc)

    signal.signal(signal.SIGHUP, _reload)
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    service.run(stop)
    return 0


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", envvar="GPUSHARE_CONFIG", help="gpushare.toml to read.")
@click.option("--parent", type=int, default=0, help="pid of the submitd that supervises this process.")
def cli(config_path: str | None, parent: int) -> int:
    """The asynchronous-estimation loop (started by gpushare-submitd)."""
    _die_with_parent(parent)
    os.nice(10)  # its squeue parses yield the CPU to the submit service's answers
    cfg = load_config(config_path)
    setup_logging("gpushare-estimationd", cfg.submit.log_file, "INFO")
    return run_loop(cfg, config_path)


if __name__ == "__main__":
    try:
        sys.exit(cli.main(prog_name="gpushare-estimationd", standalone_mode=False) or 0)
    except ConfigError as exc:
        print(f"gpushare-estimationd: {exc}", file=sys.stderr)
        sys.exit(2)
