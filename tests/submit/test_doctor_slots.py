"""gpushare doctor on the hook slots and the running slurmctld: each slot line runs what it names (a glob
matches executable files), our programs read the gpushare.toml the doctor checked, and a slurmctld still
running without what slurm.conf now says is named before anyone reconfigures. Files the tests write."""

from __future__ import annotations

import sys
from pathlib import Path

from gpushare.config import load_config
from gpushare.slurm.conf_file import read_settings
from gpushare.slurm_plugins.controller_doctor import (hook_slot_checks, parse_show_config, restart_problems,
                                                      slot_problems)
from gpushare.slurm_plugins.slurm_config import chain_wrapper, hook_wrapper

EXAMPLE = Path(__file__).resolve().parents[2] / "etc" / "gpushare.toml"


def _program(path: Path, body: str = "exit 0\n", mode: int = 0o755) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(mode)
    return str(path)


def _site(tmp_path: Path, conf: str):  # type: ignore[no-untyped-def]
    toml = tmp_path / "gpushare.toml"
    toml.write_text(EXAMPLE.read_text())
    (tmp_path / "slurm.conf").write_text(conf)
    return load_config(str(toml)), str(tmp_path / "slurm.conf")


def test_a_glob_slot_must_match_executable_files(tmp_path: Path) -> None:
    scripts = tmp_path / "prolog.d"
    scripts.mkdir()
    cfg, conf = _site(tmp_path, f"Prolog={scripts}/*.sh\nEpilog=epilog.d/*\n")
    lines = [c.detail for c in hook_slot_checks(cfg, conf, ("Prolog", "Epilog"))]
    assert any(f"{scripts}/*.sh matches no file" in line and "drained" in line for line in lines), lines
    assert any(f"{tmp_path}/epilog.d/* matches no file" in line for line in lines), lines  # beside slurm.conf
    _program(scripts / "10-ok.sh")
    _program(scripts / "20-not-executable.sh", mode=0o644)
    (tmp_path / "epilog.d").mkdir()
    _program(tmp_path / "epilog.d" / "jobstats")
    checks = hook_slot_checks(cfg, conf, ("Prolog", "Epilog"))
    assert [c.status for c in checks] == ["problem"] and "20-not-executable.sh: no executable file" in checks[0].detail
    (scripts / "20-not-executable.sh").chmod(0o755)
    checks = hook_slot_checks(cfg, conf, ("Prolog", "Epilog"))
    assert [c.status for c in checks] == ["ok"] and "2 hook line(s)" in checks[0].detail


def test_chain_wrappers_are_checked_inside(tmp_path: Path) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    _program(hooks / "gpushare-prolog")
    cfg, conf = _site(tmp_path, "")
    wrapper = tmp_path / "gpushare-chain-Prolog"
    pattern = f"{tmp_path}/prolog.d/*.sh"
    # as an older release wrote it: the pattern started as one program, no --slot, no pinned configuration
    old = chain_wrapper("Prolog", [pattern], str(hooks), cfg.source).replace(" --slot Prolog", "")
    _program(wrapper, old.removeprefix("#!/bin/sh\n"))
    problems = slot_problems(cfg, conf, "Prolog", str(wrapper))
    assert any("older gpushare" in p and "exit 127" in p for p in problems), problems
    assert any("matches no file" in p for p in problems), problems

    (tmp_path / "prolog.d").mkdir()
    _program(tmp_path / "prolog.d" / "a.sh")
    _program(wrapper, chain_wrapper("Prolog", [pattern], str(hooks), cfg.source).removeprefix("#!/bin/sh\n"))
    assert slot_problems(cfg, conf, "Prolog", str(wrapper)) == []
    gone = chain_wrapper("Prolog", [pattern], str(hooks), cfg.source).replace(sys.executable, "/gone/venv/bin/python")
    _program(wrapper, gone.removeprefix("#!/bin/sh\n"))
    problems = slot_problems(cfg, conf, "Prolog", str(wrapper))
    assert len(problems) == 1 and "/gone/venv/bin/python is gone" in problems[0], problems


def test_every_program_of_ours_reads_the_checked_configuration(tmp_path: Path) -> None:
    """slurmctld passes no SLURM_CONF to EpilogSlurmctld: our program named directly reads /etc/slurm's file
    (or runs on defaults), not the one `gpushare config check` read elsewhere; a wrapper pins it."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    bare = _program(hooks / "gpushare-epilog-slurmctld")
    cfg, conf = _site(tmp_path, f"EpilogSlurmctld={bare}\n")
    problems = slot_problems(cfg, conf, "EpilogSlurmctld", bare)
    assert len(problems) == 1 and "/etc/slurm/gpushare.toml" in problems[0] and cfg.source in problems[0]

    wrapper = tmp_path / "gpushare-hook-EpilogSlurmctld"
    _program(wrapper, hook_wrapper("EpilogSlurmctld", str(hooks), cfg.source).removeprefix("#!/bin/sh\n"))
    assert slot_problems(cfg, conf, "EpilogSlurmctld", str(wrapper)) == []
    (hooks / "gpushare-epilog-slurmctld").unlink()  # the release it named was removed
    problems = slot_problems(cfg, conf, "EpilogSlurmctld", str(wrapper))
    assert len(problems) == 1 and "gpushare-epilog-slurmctld is gone" in problems[0], problems
    _program(hooks / "gpushare-epilog-slurmctld")
    other = tmp_path / "other.toml"
    other.write_text(EXAMPLE.read_text())
    _program(wrapper, hook_wrapper("EpilogSlurmctld", str(hooks), str(other)).removeprefix("#!/bin/sh\n"))
    problems = slot_problems(cfg, conf, "EpilogSlurmctld", str(wrapper))
    assert len(problems) == 1 and f"reads {other}" in problems[0], problems
    other.unlink()
    problems = slot_problems(cfg, conf, "EpilogSlurmctld", str(wrapper))
    assert len(problems) == 1 and "which is no file" in problems[0], problems


# `scontrol show config` of a 22.05 slurmctld started before the printed lines were merged (abridged)
RUNNING_BEFORE = """Configuration data as of 2026-11-28T15:00:00
AccountingStorageBackupHost = (null)
AccountingStorageEnforce = associations,limits,qos
AccountingStorageHost   = ctl
AccountingStorageTRES   = cpu,mem,energy,node,billing,fs/disk,vmem,pages,gres/gpu
AccountingStorageType   = accounting_storage/slurmdbd
GresTypes               = gpu
JobSubmitPlugins        = lua
TRESBillingWeights      = (null)
"""


def test_a_running_slurmctld_without_the_new_lines_is_named(tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text("GresTypes=gpu,shard\nAccountingStorageTRES=gres/gpu,gres/shard\n"
                    'PartitionName=gpu Nodes=n[1-4] TRESBillingWeights="CPU=1,GRES/gpu=40,GRES/shard=1"\n')
    running = parse_show_config(RUNNING_BEFORE)
    assert running["grestypes"] == "gpu" and running["tresbillingweights"] == ""
    problems = restart_problems(running, read_settings(conf))
    assert len(problems) == 3, problems
    assert problems[0].startswith("GresTypes: slurm.conf has shard") and "gres/shard" in problems[1]
    assert "GRES/shard".lower() in problems[2] and "failed to parse tres weights str" in problems[2]
    after = RUNNING_BEFORE.replace("pages,gres/gpu", "pages,gres/gpu,gres/shard").replace("= gpu\n", "= gpu,shard\n")
    assert restart_problems(parse_show_config(after), read_settings(conf)) == []


def test_without_systemd_the_timers_line_names_each_command(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import os

    from gpushare.config import parse_config
    from gpushare.slurm_plugins.controller_doctor import timer_checks

    real_isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda path: False if path == "/run/systemd/system" else real_isdir(path))
    lines = [c.detail for c in timer_checks(parse_config({}))]
    assert lines == ["no systemd here: run `gpushare-epilog-slurmctld --resume` as SlurmUser every 2 minutes (cron), "
                     "as gpushare-oom-resume.timer does"]
    units = Path(__file__).resolve().parents[2] / "etc" / "systemd"
    assert "gpushare-epilog-slurmctld --resume" in (units / "gpushare-oom-resume.service").read_text()
    assert "OnUnitInactiveSec=2min" in (units / "gpushare-oom-resume.timer").read_text()


def test_the_lua_module_asks_the_socket_of_the_checked_configuration(tmp_path: Path) -> None:
    from gpushare.config import parse_config
    from gpushare.slurm_plugins.controller_doctor import lua_module_check
    from gpushare.slurm_plugins.slurm_config import render_lua_module

    cfg, conf = _site(tmp_path, "")
    assert lua_module_check(cfg, conf) is None  # no module here
    (tmp_path / "gpushare_submit.lua").write_text(render_lua_module(cfg))
    assert lua_module_check(cfg, conf).status == "ok"  # type: ignore[union-attr]
    other = parse_config({"submit": {"socket": "/run/other/submitd.sock"}})
    (tmp_path / "gpushare_submit.lua").write_text(render_lua_module(other))
    check = lua_module_check(cfg, conf)
    assert check is not None and check.status == "problem" and "/run/other/submitd.sock" in check.detail


def test_ours_on_any_epilogslurmctld_line_counts(tmp_path: Path) -> None:
    from gpushare.slurm.conf_file import read_keys
    from gpushare.slurm_plugins.controller_doctor import hook_lines_check

    conf = tmp_path / "slurm.conf"
    conf.write_text("JobSubmitPlugins=lua\nEpilogSlurmctld=/opt/gpushare/bin/gpushare-epilog-slurmctld\n"
                    "EpilogSlurmctld=/usr/local/jobstats/slurmctldepilog.sh\n")  # Slurm 24.05+: both run
    (tmp_path / "job_submit.lua").write_text("require('gpushare_submit')\n")
    checks = hook_lines_check(read_keys(conf), str(conf))
    assert [c.status for c in checks] == ["ok"], checks


def test_each_installed_unit_reads_the_checked_configuration(tmp_path: Path) -> None:
    import shutil

    from gpushare.slurm_plugins.controller_doctor import unit_config_checks

    cfg, _ = _site(tmp_path, "")
    units = tmp_path / "system"
    units.mkdir()
    shipped = Path(__file__).resolve().parents[2] / "etc" / "systemd"
    for name in ("gpushare-submitd.service", "gpushare-oom-resume.service"):
        shutil.copy(shipped / name, units / name)
    checks = unit_config_checks(cfg, str(units))  # the shipped units name /etc/slurm/gpushare.toml
    assert [c.status for c in checks] == ["problem", "problem"] and "systemctl edit" in checks[0].detail
    for name in ("gpushare-submitd.service", "gpushare-oom-resume.service"):  # what `systemctl edit` writes
        (units / f"{name}.d").mkdir()
        (units / f"{name}.d" / "override.conf").write_text(f"[Service]\nEnvironment=GPUSHARE_CONFIG={cfg.source}\n")
    assert [c.status for c in unit_config_checks(cfg, str(units))] == ["ok"]


def test_a_sites_own_wrapper_that_exports_the_file_pins_it(tmp_path: Path) -> None:
    """A site may start our hook from a wrapper of its own (``export GPUSHARE_CONFIG=FILE``, then our program):
    that pins the file as our generated wrappers do, and the doctor says nothing when it is the checked one and
    names it when it is another."""
    cfg, conf = _site(tmp_path, "")
    wrapper = tmp_path / "gpushare-epilog-slurmctld"
    _program(wrapper, f"export GPUSHARE_CONFIG='{cfg.source}'\nexec /opt/gpushare/bin/gpushare-epilog-slurmctld \"$@\"\n")
    assert slot_problems(cfg, conf, "EpilogSlurmctld", str(wrapper)) == []
    other = tmp_path / "other.toml"
    other.write_text(EXAMPLE.read_text())
    _program(wrapper, f"  export GPUSHARE_CONFIG={other}\nexec /opt/gpushare/bin/gpushare-epilog-slurmctld \"$@\"\n")
    problems = slot_problems(cfg, conf, "EpilogSlurmctld", str(wrapper))
    assert len(problems) == 1 and f"reads {other} (GPUSHARE_CONFIG in the wrapper)" in problems[0], problems


def test_a_bare_hook_that_would_find_no_file_is_named_with_what_it_does(tmp_path: Path, monkeypatch) -> None:
    """Where Slurm starts our program with nothing naming the file and none is at the standard place, the hook
    logs one ERROR line and does nothing: the doctor says so (it once said only which file it 'reads'); a file
    there that is not the checked one is the other problem."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    bare = _program(hooks / "gpushare-epilog-slurmctld")
    cfg, conf = _site(tmp_path, f"EpilogSlurmctld={bare}\n")
    standard = tmp_path / "etc-slurm" / "gpushare.toml"
    monkeypatch.setattr("gpushare.config.DEFAULT_PATH", standard)
    [problem] = slot_problems(cfg, conf, "EpilogSlurmctld", bare)
    assert f"finds no gpushare.toml where Slurm starts it (it tries {standard})" in problem, problem
    assert "does nothing" in problem and "--install-hooks" in problem and cfg.source in problem
    standard.parent.mkdir()
    standard.write_text("version = 1\n")
    [problem] = slot_problems(cfg, conf, "EpilogSlurmctld", bare)
    assert f"reads {standard}" in problem and cfg.source in problem, problem
