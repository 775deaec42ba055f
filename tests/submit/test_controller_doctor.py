"""``gpushare doctor`` on the controller names each way the slurmctld path fails when SlurmUser is ``slurm``.

A real gpushare-submitd (root, as its unit runs it) beside a slurm.conf with the distributions' default
``SlurmUser=slurm``; the doctor probes the socket as that account. Each failure is injected for real (a
socket whose group slurmctld lacks, a stopped service, a Lua whose lua-socket cannot load, missing
slurm.conf lines, a ledger that root owns) and must come out as one problem line that names its fix.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from devcluster.slurm_runtime import slurm_account
from gpushare.config import parse_config
from gpushare.slurm.conf_file import read_keys
from gpushare.slurm_plugins.controller_doctor import is_controller
from gpushare.slurm_plugins.slurm_config import render_lua

BIN = Path(sys.executable).parent
GOOD_CONF = ("ClusterName=doc\nSlurmctldHost={host}\nSlurmUser=slurm\nJobSubmitPlugins=lua\n"
             "EpilogSlurmctld={bin}/gpushare-epilog-slurmctld\nAccountingStorageType=accounting_storage/slurmdbd\n"
             "AccountingStorageTRES=gres/gpu,gres/shard\n")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the doctor probes as slurmctld's account")


class Site:
    """A controller's files under one folder slurm can traverse, and the service running beside them."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="gpushare-doctor-", dir="/tmp"))
        os.chmod(self.base, 0o755)
        self.socket = self.base / "submitd.sock"
        self.toml = self.base / "gpushare.toml"
        self.conf = self.base / "slurm.conf"
        self.toml.write_text(f'version = 1\n[submit]\nsocket = "{self.socket}"\ncache_dir = "{self.base / "cache"}"\n'
                             f'[oom]\nledger_dir = "{self.base / "ledger"}"\n')
        self.write_conf(GOOD_CONF)
        cfg = parse_config({"submit": {"socket": str(self.socket)}})
        (self.base / "job_submit.lua").write_text(render_lua(cfg))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "GPUSHARE_CONFIG": str(self.toml)}
        self.proc: subprocess.Popen | None = None

    def write_conf(self, template: str) -> None:
        self.conf.write_text(template.format(host=socket.gethostname(), bin=BIN))

    def start(self) -> None:
        self.proc = subprocess.Popen([str(BIN / "gpushare-submitd"), "--config", str(self.toml)], env=self.env,
                                     stdout=subprocess.DEVNULL, stderr=open(self.base / "submitd.log", "wb"))
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, (self.base / "submitd.log").read_text()
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)
            self.proc = None

    def doctor(self, **env: str) -> dict[str, list[str]]:
        out = subprocess.run([str(BIN / "gpushare"), "doctor", "--no-slurm", "--controller"],
                             env={**self.env, **env}, capture_output=True, text=True, timeout=60)
        lines: dict[str, list[str]] = {}
        for line in out.stdout.splitlines():
            name, _, rest = line.partition(" ")
            lines.setdefault(name, []).append(rest.strip())
        return lines


@pytest.fixture
def site():  # type: ignore[no-untyped-def]
    slurm_account()
    site = Site()
    site.start()
    yield site
    site.stop()
    shutil.rmtree(site.base, ignore_errors=True)


def _status(lines: dict[str, list[str]], name: str) -> str:
    return " | ".join(lines.get(name, ["(absent)"]))


def test_a_correct_controller_passes_every_check(site: Site) -> None:
    lines = site.doctor()
    assert _status(lines, "slurmuser").startswith("ok") and "slurm" in _status(lines, "slurmuser")
    assert _status(lines, "socket").startswith("ok"), lines  # slurm reaches the root service through the group
    assert _status(lines, "hooks").startswith("ok"), lines
    assert _status(lines, "accounting").startswith("ok"), lines
    assert _status(lines, "owners").startswith("ok"), lines  # the service made the ledger slurm's
    assert Path(site.base / "ledger").stat().st_uid == slurm_account().pw_uid
    if shutil.which("lua5.1"):
        assert _status(lines, "lua").startswith("ok"), lines


def test_a_socket_slurm_cannot_reach_is_named_with_its_fix(site: Site) -> None:
    os.chown(site.socket, -1, 0)  # as the service left it before it knew SlurmUser: root's group
    socket_line = _status(site.doctor(), "socket")
    assert socket_line.startswith("problem") and "socket_group" in socket_line, socket_line
    site.stop()
    socket_line = _status(site.doctor(), "socket")
    assert socket_line.startswith("problem") and "start gpushare-submitd" in socket_line, socket_line


def test_missing_lines_a_lua_without_sockets_and_a_foreign_ledger_are_named(site: Site) -> None:
    site.write_conf(GOOD_CONF.replace("JobSubmitPlugins=lua\n", "").replace("gres/gpu,gres/shard", "gres/gpu")
                    .replace("EpilogSlurmctld={bin}/gpushare-epilog-slurmctld\n", "EpilogSlurmctld=/usr/local/site.sh\n"))
    os.chown(site.base / "ledger", 0, 0)
    lines = site.doctor(LUA_CPATH="/nonexistent/?.so", LUA_PATH="/nonexistent/?.lua")
    hooks = _status(lines, "hooks")
    assert "JobSubmitPlugins" in hooks and "EpilogSlurmctld" in hooks and hooks.count("problem") == 2, hooks
    accounting = _status(lines, "accounting")
    assert accounting.startswith("problem") and "gres/shard" in accounting, accounting
    owners = _status(lines, "owners")
    assert owners.startswith("problem") and f"chown -R slurm:slurm {site.base / 'ledger'}" in owners, owners
    lua = _status(lines, "lua")
    if shutil.which("lua5.1"):  # Debian's Slurm links Lua 5.1
        assert lua.startswith("problem") and "lua-socket" in lua, lua


def test_the_controller_is_found_by_slurmctldhost(tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"SlurmctldHost={socket.gethostname()}(127.0.0.1)\n")
    assert is_controller(read_keys(conf))
    conf.write_text("SlurmctldHost=elsewhere\nInclude extra.conf\n")
    (tmp_path / "extra.conf").write_text("SlurmUser=slurm # the packages' default\n")
    keys = read_keys(conf)
    assert not is_controller(keys) and keys["slurmuser"] == "slurm"
