"""Install beside a site's own slurm.conf and job_submit.lua as docs/deployment.md says, then remove gpushare the
same way: the site's files come back byte for byte, and what stays is listed. Files the test writes."""

from __future__ import annotations

from pathlib import Path

from devcluster.admin_steps import apply_uninstall, paste
from gpushare.cli import main as gpushare_main

EXAMPLE = Path(__file__).resolve().parents[2] / "etc" / "gpushare.toml"
HOOK_KEYS = ("Prolog", "Epilog", "TaskProlog", "TaskEpilog", "EpilogSlurmctld", "MailProg")
SITE_CONF = """ClusterName=site
SlurmUser=slurm
Prolog=prolog.d/*.sh
Epilog=/etc/slurm/epilog.d/*
Epilog=/usr/local/sbin/site-epilog
TaskProlog=/usr/local/sbin/site-taskprolog
EpilogSlurmctld=/usr/local/jobstats/slurmctldepilog.sh
MailProg=/usr/bin/smail
JobSubmitPlugins=lua
PartitionName=gpu Nodes=g[1-2] Default=YES State=UP
"""
SITE_LUA = "-- the site's own rules\nfunction slurm_job_submit(job_desc, part_list, submit_uid)\n  return slurm.SUCCESS\nend\n"


def test_install_then_uninstall_leaves_the_sites_files_byte_identical(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    etc = tmp_path / "etc-slurm"
    etc.mkdir()
    conf, lua = etc / "slurm.conf", etc / "job_submit.lua"
    conf.write_text(SITE_CONF)
    lua.write_text(SITE_LUA)
    before = {path.name: path.read_bytes() for path in etc.iterdir()}

    args = ["slurm-config", "--config", str(EXAMPLE), "--slurm-conf", str(conf), "--slurm-version", "22.05",
            "--hook-dir", str(tmp_path / "venv-bin")]
    assert gpushare_main([*args, "--install-lua", str(etc), "--install-hooks", str(etc / "gpushare-hooks"),
                          "--install-chains", str(etc / "gpushare-chains")]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.split("=", 1)[0] in HOOK_KEYS]
    assert lua.read_bytes() == before["job_submit.lua"]  # never rewritten: the two lines are printed
    conf.write_text(paste(SITE_CONF, printed))
    installed = conf.read_text()
    keys = [line.split("=", 1)[0] for line in installed.splitlines()]
    assert "prolog.d" not in installed and keys.count("Epilog") == 1 and "TaskEpilog" in keys

    assert gpushare_main([*args, "--uninstall"]) == 0
    out = capsys.readouterr().out
    conf.write_text(apply_uninstall(installed, out))
    for name in ("gpushare_submit.lua", "gpushare-hooks", "gpushare-chains"):  # step 4 of the page
        path = etc / name
        if path.is_dir():
            for child in path.iterdir():
                child.unlink()
            path.rmdir()
        else:
            path.unlink()
    assert {path.name: path.read_bytes() for path in etc.iterdir()} == before
    assert "shard from GresTypes" in out and "gres/shard from AccountingStorageTRES" in out and "GRES/shard" in out
    assert f"left on purpose: {EXAMPLE}" in out
