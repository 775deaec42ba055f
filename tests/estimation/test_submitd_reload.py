"""gpushare-submitd started without asynchronous estimation must start the estimation thread when a
configuration reload (SIGHUP) turns ``without_estimate = "async"`` on: jobs held from then on need it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _config(path: Path, tmp_path: Path, mode: str) -> None:
    extra = (f'[estimation]\npartition = "cpu"\npoll_s = 0.2\nspool_dir = "{tmp_path}/spool"\n'
             if mode == "async" else "")
    path.write_text(f'[policy]\nwithout_estimate = "{mode}"\n[submit]\ncache_dir = "{tmp_path}/cache"\n{extra}')


def _wait_for(log: Path, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text():
            return True
        time.sleep(0.1)
    return False


def test_reload_to_async_starts_the_estimation_thread(tmp_path: Path) -> None:
    config, log, sock = tmp_path / "gpushare.toml", tmp_path / "submitd.log", tmp_path / "submitd.sock"
    _config(config, tmp_path, "recover")
    with open(log, "wb") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "gpushare.slurm_plugins.submitd", "--config", str(config),
                                 "--socket", str(sock)], stdout=handle, stderr=subprocess.STDOUT,
                                env={**os.environ, "PATH": "/usr/bin:/bin"})
    try:
        assert _wait_for(log, "listening on", 30), log.read_text()
        assert "asynchronous estimation" not in log.read_text()
        _config(config, tmp_path, "async")
        os.kill(proc.pid, signal.SIGHUP)
        assert _wait_for(log, "asynchronous estimation on partition cpu", 10), log.read_text()
        os.kill(proc.pid, signal.SIGHUP)  # a second reload does not start a second thread
        assert _wait_for(log, "configuration reloaded", 10)
        time.sleep(0.5)
        assert log.read_text().count("asynchronous estimation on partition") == 1
    finally:
        proc.terminate()
        proc.wait(10)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def test_estimation_runs_in_its_own_process_that_dies_with_submitd(tmp_path: Path) -> None:
    """squeue parses must never share the submit service's interpreter; a SIGKILLed submitd must not
    leave an orphan loop that a restarted one would double."""
    from gpushare.slurm_plugins.estimation_process import single_instance_lock

    config, log, sock = tmp_path / "gpushare.toml", tmp_path / "submitd.log", tmp_path / "submitd.sock"
    _config(config, tmp_path, "async")
    with open(log, "wb") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "gpushare.slurm_plugins.submitd", "--config", str(config),
                                 "--socket", str(sock)], stdout=handle, stderr=subprocess.STDOUT,
                                env={**os.environ, "PATH": "/usr/bin:/bin"})
    child = None
    try:
        assert _wait_for(log, "asynchronous estimation on partition cpu", 30), log.read_text()
        children = _children(proc.pid)
        assert len(children) == 1
        child = children[0]
        assert "estimation_process" in Path(f"/proc/{child}/cmdline").read_text()
        assert single_instance_lock(str(tmp_path / "spool")) is None  # the child holds the loop's lock
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{child}").exists() and \
                "Z" not in Path(f"/proc/{child}/stat").read_text().split()[2]:
            time.sleep(0.1)
        assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
        assert single_instance_lock(str(tmp_path / "spool")) is not None  # free for the next submitd
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if child and Path(f"/proc/{child}").exists():
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
