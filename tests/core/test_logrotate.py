"""etc/logrotate.d/gpushare rotates a running program's log: the real logrotate, the shipped directives (only
the paths pointed at a temporary directory), and a live process logging through gpushare.logs before and
after the rotation. No copytruncate, no signal: the program must open a new file where the old one was."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "etc" / "logrotate.d" / "gpushare"
WRITER = """
import logging, sys
from gpushare.logs import setup_logging
setup_logging("gpushare-agent", sys.argv[1])
log = logging.getLogger("gpushare.agent")
log.warning("before the rotation")
sys.stdin.readline()
log.warning("after the rotation")
"""


def test_a_running_program_writes_into_a_new_file_after_the_rotation(tmp_path: Path) -> None:
    logrotate = shutil.which("logrotate") or shutil.which("logrotate", path="/usr/sbin:/sbin")
    if logrotate is None:
        pytest.skip("logrotate is not installed (make setup installs it)")
    logs = tmp_path / "log" / "gpushare"
    logs.mkdir(parents=True)
    text = SHIPPED.read_text()
    paths = "/var/log/gpushare/*.log /var/log/slurm/gpushare-*.log {"
    assert paths in text
    conf = tmp_path / "gpushare.logrotate"
    conf.write_text(text.replace(paths, f"{logs}/*.log {{"))
    conf.chmod(0o644)
    log = logs / "agent.log"

    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(log)], stdin=subprocess.PIPE, text=True,
                              cwd=ROOT)
    try:
        deadline = time.monotonic() + 20
        while not log.exists() or "before the rotation" not in log.read_text():
            assert time.monotonic() < deadline and writer.poll() is None, "the writer did not log"
            time.sleep(0.05)
        done = subprocess.run([logrotate, "-f", "-s", str(tmp_path / "state"), str(conf)], capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        rotated = logs / "agent.log.1"  # delaycompress: the newest rotation stays readable
        assert "before the rotation" in rotated.read_text() and not log.exists()  # nocreate
        assert writer.stdin is not None
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.wait(20) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert "after the rotation" in log.read_text()  # into the new file at the same path
    assert "after the rotation" not in rotated.read_text()
