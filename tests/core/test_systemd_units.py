"""The shipped systemd units are valid and right for a co-located install (controller + GPU node).

``systemd-analyze verify`` checks syntax and that the executables exist (pointed at this install's
entry points); the static checks pin what went wrong before: submitd ran as ``slurm`` though asynchronous
estimation needs root, its ``StateDirectory=`` recursively chowned /var/lib/gpushare, and it shared
/run/gpushare with the agent under another mode (and removed it on stop). A real start needs systemd as
PID 1 and runs only there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "etc" / "systemd"


def _service(name: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    section = ""
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values.setdefault(f"{section}.{key}", []).append(value)
    return values


def test_units_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if not analyze:
        pytest.skip("systemd-analyze not installed")
    bin_dir = os.path.dirname(sys.executable)
    for unit in UNITS.iterdir():
        (tmp_path / unit.name).write_text(unit.read_text().replace("/usr/local/bin/", f"{bin_dir}/"))
    units = sorted(str(p) for p in tmp_path.iterdir())
    proc = subprocess.run([analyze, "verify", "--man=no", *units], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    problems = [line for line in proc.stderr.splitlines() if "slurmd.service" not in line
                and "slurmctld.service" not in line and "nvidia-persistenced" not in line and "munge" not in line]
    assert proc.returncode == 0 or not problems, proc.stderr


def test_submitd_runs_as_root_without_state_directory_chown() -> None:
    submitd = _service("gpushare-submitd.service")
    assert submitd["Service.User"] == ["root"]  # sbatch --uid and chown of spool directories
    assert "Service.StateDirectory" not in submitd  # would chown -R /var/lib/gpushare to the unit's user
    assert "/var/lib/gpushare" in submitd["Service.ReadWritePaths"][0]
    # ProtectSystem=strict: the log paths docs/deployment.md suggests must be writable too
    writable = submitd["Service.ReadWritePaths"][0].split()
    docs = (Path(__file__).resolve().parents[2] / "docs" / "deployment.md").read_text()
    for log in ("/var/log/gpushare/submitd.log", "/var/log/slurm/gpushare-oom.log"):
        assert log in docs and any(log.startswith(p.lstrip("-") + "/") for p in writable), (log, writable)


def test_units_sharing_run_gpushare_agree_and_keep_it() -> None:
    sharing = [name for name in os.listdir(UNITS) if name.endswith(".service")
               and _service(name).get("Service.RuntimeDirectory") == ["gpushare"]]
    assert {"gpushare-submitd.service", "gpushare-agent.service"} <= set(sharing)
    assert {tuple(_service(n).get("Service.RuntimeDirectoryMode", [])) for n in sharing} == {("0755",)}
    assert all(_service(n).get("Service.RuntimeDirectoryPreserve") == ["yes"] for n in sharing)


def test_interrupted_recoveries_have_a_timer() -> None:
    service = _service("gpushare-oom-resume.service")
    assert service["Service.ExecStart"][0].endswith("gpushare-epilog-slurmctld --resume")
    assert "Timer.OnUnitInactiveSec" in _service("gpushare-oom-resume.timer")


def test_held_jobs_have_a_watchdog_that_does_not_need_the_service() -> None:
    service = _service("gpushare-estimation-watchdog.service")
    assert service["Service.ExecStart"][0].endswith("gpushare estimates --release-overdue")
    assert service["Service.User"] == ["root"]  # it updates and releases other users' jobs
    assert "Timer.OnUnitInactiveSec" in _service("gpushare-estimation-watchdog.timer")
