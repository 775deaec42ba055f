"""`gpushare slurm-config`: slurm.conf/gres.conf lines from gpushare.toml, and a valid job_submit.lua."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gpushare.cli import main as gpushare_main

EXAMPLE = Path(__file__).resolve().parents[2] / "etc" / "gpushare.toml"


def test_prints_lines_and_installs_lua(tmp_path, capsys):
    assert gpushare_main(["slurm-config", "--config", str(EXAMPLE), "--hook-dir", "/opt/gs/bin",
                          "--install-lua", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GresTypes=gpu,shard" in out and "JobSubmitPlugins=lua" in out
    assert "Prolog=/opt/gs/bin/gpushare-prolog" in out and "EpilogSlurmctld=/opt/gs/bin/gpushare-epilog-slurmctld" in out
    # 4 × A100-80GB = 320 shards; 8 × H100-80GB (79 GiB each) = 632 shards
    assert "NodeName=gpu[01-04] Gres=gpu:a100-80gb:4,shard:320" in out
    assert "NodeName=gpu[05-06] Gres=gpu:h100-80gb:8,shard:632" in out
    assert "NodeName=gpu[01-04] Name=shard Count=80 File=/dev/nvidia3" in out
    lua = (tmp_path / "job_submit.lua").read_text()
    assert '"/run/gpushare/submitd.sock"' in lua and "DEADLINE_S = 0.250" in lua and "@" not in lua


def test_rendered_lua_compiles(tmp_path):
    luac = shutil.which("luac5.1")
    if not luac:
        pytest.skip("luac5.1 not installed (apt-get install lua5.1)")
    assert gpushare_main(["slurm-config", "--config", str(EXAMPLE), "--install-lua", str(tmp_path)]) == 0
    subprocess.run([luac, "-p", str(tmp_path / "job_submit.lua")], check=True)


def test_config_without_nodes_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "gpushare.toml"
    path.write_text("version = 1\n")
    assert gpushare_main(["slurm-config", "--config", str(path)]) == 1
    assert "no [[nodes]] tables" in capsys.readouterr().err
