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
                          "--slurm-conf", str(tmp_path / "absent.conf"), "--install-lua", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GresTypes=gpu,shard" in out and "JobSubmitPlugins=lua" in out
    assert "Prolog=/opt/gs/bin/gpushare-prolog" in out and "EpilogSlurmctld=/opt/gs/bin/gpushare-epilog-slurmctld" in out
    # 4 × A100-80GB = 320 shards; 8 × H100-80GB (79 GiB each) = 632 shards
    assert "NodeName=gpu[01-04] Gres=gpu:a100-80gb:4,shard:320" in out
    assert "NodeName=gpu[05-06] Gres=gpu:h100-80gb:8,shard:632" in out
    assert "NodeName=gpu[01-04] Name=shard Count=80 File=/dev/nvidia3" in out
    # no slurmdbd in the site's slurm.conf: slurmctld would refuse to start with GRES accounting, so commented
    assert "\n# AccountingStorageTRES=gres/gpu,gres/shard\n" in out
    # a GPU bills its GiB, a shard one: shard:20 on an A100-80GB bills a quarter of the GPU
    assert 'TRESBillingWeights="CPU=<c>,Mem=<m>,GRES/gpu=80,GRES/shard=1"' in out

    module = (tmp_path / "gpushare_submit.lua").read_text()
    assert '"/run/gpushare/submitd.sock"' in module and "DEADLINE_S = 0.250" in module and "@" not in module
    lua = (tmp_path / "job_submit.lua").read_text()  # none was there: a loader of the module is written
    assert f'package.path = "{tmp_path.resolve()}/?.lua;"' in lua and 'require("gpushare_submit")' in lua
    assert "@" not in lua


def test_accounting_lines_are_active_with_slurmdbd(tmp_path, capsys):
    (tmp_path / "slurm.conf").write_text("AccountingStorageType=accounting_storage/slurmdbd\n")
    assert gpushare_main(["slurm-config", "--config", str(EXAMPLE), "--slurm-version", "22.05",
                          "--slurm-conf", str(tmp_path / "slurm.conf")]) == 0
    assert "\nAccountingStorageTRES=gres/gpu,gres/shard\n" in capsys.readouterr().out


def test_install_keeps_the_sites_job_submit_lua(tmp_path, capsys):
    site = tmp_path / "job_submit.lua"
    site.write_text("-- the site's own rules\nfunction slurm_job_submit() return slurm.SUCCESS end\n")
    before = site.read_bytes()
    assert gpushare_main(["slurm-config", "--config", str(EXAMPLE), "--install-lua", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert site.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "gpushare_submit.lua", "job_submit.lua"]  # no backup or stray files either: nothing was replaced
    assert f"### kept {site}" in out
    assert f'package.path = "{tmp_path.resolve()}/?.lua;" .. package.path; local gpushare = require(' in out
    assert "gpushare.job_submit(job_desc, part_list, submit_uid)" in out


def test_rendered_lua_compiles(tmp_path):
    luac = shutil.which("luac5.1")
    if not luac:
        pytest.skip("luac5.1 not installed (apt-get install lua5.1)")
    assert gpushare_main(["slurm-config", "--config", str(EXAMPLE), "--install-lua", str(tmp_path)]) == 0
    subprocess.run([luac, "-p", str(tmp_path / "job_submit.lua"), str(tmp_path / "gpushare_submit.lua")], check=True)


def test_config_without_nodes_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "gpushare.toml"
    path.write_text("version = 1\n")
    assert gpushare_main(["slurm-config", "--config", str(path)]) == 1
    assert "no [[nodes]] tables" in capsys.readouterr().err


def test_mig_nodes_get_lines_of_their_own_and_a_standby_node_declaring_every_profile(tmp_path, capsys):
    """The MIG executor rewrites one node's lines, so a MIG group is written node by node; and 22.05
    refuses --gres=gpu:3g.20gb:1 unless some node declares the type (docs/mig.md)."""
    path = tmp_path / "gpushare.toml"
    path.write_text('[[nodes]]\nnames = "gpu[01-02]"\ngpu = "a100-40gb"\ncount = 4\n'
                    '[[nodes]]\nnames = "mig[08-10]"\ngpu = "a100-40gb"\ncount = 2\nmig = true\ncpus = 64\n')
    assert gpushare_main(["slurm-config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "NodeName=gpu[01-02] Gres=gpu:a100-40gb:4,shard:160 State=UNKNOWN" in out  # untouched
    for node in ("mig08", "mig09", "mig10"):
        assert f"NodeName={node} Gres=gpu:a100-40gb:2,shard:80 CPUs=64 State=UNKNOWN" in out
        assert f"NodeName={node} Name=gpu Type=a100-40gb File=/dev/nvidia[0-1]" in out
    # the most instances of each profile one node could hold: 7 × 1g.5gb per GPU, 2 GPUs
    assert ("NodeName=gpushare-mig-standby-gpu State=FUTURE Gres=gpu:1g.5gb:14,gpu:1g.10gb:8,gpu:2g.10gb:6,"
            "gpu:3g.20gb:4,gpu:4g.20gb:2,gpu:7g.40gb:2 CPUs=64 RealMemory=4194304") in out
    assert "PartitionName=gpu Nodes=gpu[01-02],mig[08-10],gpushare-mig-standby-gpu State=UP" in out
    assert "go into gpushare-mig.conf and their gres.conf lines into gpushare-mig-gres.conf" in out


@pytest.mark.parametrize("text, needle", [
    ('names = "a"\ngpu = "l40s-48gb"\nmig = true', "l40s-48gb has no MIG"),
    ('names = "m[1-2][3]"\ngpu = "a100-40gb"\nmig = true', "list the nodes one by one"),
    ('names = "m[5-2]"\ngpu = "a100-40gb"\nmig = true', "bad range '5-2'"),
])
def test_bad_mig_node_groups_are_one_line_errors_before_any_output(tmp_path, capsys, text, needle):
    path = tmp_path / "gpushare.toml"
    path.write_text(f"[[nodes]]\n{text}\n")
    assert gpushare_main(["slurm-config", "--config", str(path)]) == 1
    out, err = capsys.readouterr()
    assert needle in err and out == ""


def test_lines_follow_the_slurm_release(tmp_path, capsys) -> None:
    """24.11+ gets the least-loaded shard placement offer and the cgroup.conf line for cgroup-less nodes."""
    assert gpushare_main(["slurm-config", "--config", str(EXAMPLE), "--slurm-version", "22.05"]) == 0
    old = capsys.readouterr().out
    assert "Slurm 22.05" in old and "LL_SHARED_GRES" not in old and "CgroupPlugin" not in old
    assert gpushare_main(["slurm-config", "--config", str(EXAMPLE), "--slurm-version", "24.11"]) == 0
    new = capsys.readouterr().out
    assert "LL_SHARED_GRES" in new and "### cgroup.conf" in new and "CgroupPlugin=disabled" in new
    assert gpushare_main(["slurm-config", "--config", str(EXAMPLE), "--slurm-version", "banana"]) == 1
