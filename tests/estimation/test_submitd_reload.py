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
