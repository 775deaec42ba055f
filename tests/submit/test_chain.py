"""One hook slot, two programs: the site's and ours, run as real processes through the wrappers
`gpushare slurm-config --install-chains` writes. The site's status and output are kept; ours fails open."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from gpushare.cli import main as gpushare_main

EXAMPLE = Path(__file__).resolve().parents[2] / "etc" / "gpushare.toml"


def _program(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def _install(tmp_path: Path, conf: str, capsys) -> tuple[str, Path]:  # type: ignore[no-untyped-def]
    (tmp_path / "slurm.conf").write_text(conf)
    hooks, chains = tmp_path / "hooks", tmp_path / "chains"
    hooks.mkdir()
    chains.mkdir()
    assert gpushare_main(["slurm-config", "--config", str(EXAMPLE), "--hook-dir", str(hooks), "--slurm-version",
                          "22.05", "--slurm-conf", str(tmp_path / "slurm.conf"), "--install-chains", str(chains)]) == 0
    return capsys.readouterr().out, hooks


def _run(wrapper: Path, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([str(wrapper), *args], input=stdin, capture_output=True, timeout=60)


def test_site_and_ours_both_run_and_the_sites_status_wins(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    site = _program(tmp_path / "site-taskprolog", 'echo "export SITE_VAR=1"; echo "site args: $*"; '
                    'cat > "$0.stdin"; exit 3\n')
    out, hooks = _install(tmp_path, f"ClusterName=t\nTaskProlog={site}\nEpilogSlurmctld=/nonexistent/site-epilog\n",
                          capsys)
    wrapper = tmp_path / "chains" / "gpushare-chain-TaskProlog"
    assert f"TaskProlog={wrapper}" in out and f"runs TaskProlog={site}" in out
    assert "TaskEpilog=" + str(hooks / "gpushare-task-epilog") in out  # the site has none there: ours alone
    _program(hooks / "gpushare-task-prolog", 'echo "export OURS_VAR=2"; cat > "$0.stdin"; exit 1\n')

    done = _run(wrapper, "a b", "c", stdin=b"body\n")
    assert done.returncode == 3  # the site's status, although ours failed too
    assert done.stdout.decode().splitlines() == ["export SITE_VAR=1", "site args: a b c", "export OURS_VAR=2"]
    assert b"exited 1; the hook's status stays the site's (3)" in done.stderr
    assert Path(site + ".stdin").read_bytes() == b"body\n" == (hooks / "gpushare-task-prolog.stdin").read_bytes()

    # the site's program that cannot start: 127 as a shell says, and ours still runs (OOM recovery must)
    epilog = tmp_path / "chains" / "gpushare-chain-EpilogSlurmctld"
    _program(hooks / "gpushare-epilog-slurmctld", 'echo ours-ran > "$0.ran"\n')
    done = _run(epilog)
    assert done.returncode == 127 and (hooks / "gpushare-epilog-slurmctld.ran").read_text() == "ours-ran\n"


def test_ours_missing_or_hung_never_changes_the_hook(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    site = _program(tmp_path / "site-epilog", "exit 0\n")
    _, hooks = _install(tmp_path, f"TaskEpilog={site}\nEpilog={site}\n", capsys)
    done = _run(tmp_path / "chains" / "gpushare-chain-TaskEpilog")  # ours not installed in hooks/
    assert done.returncode == 0 and b"could not start" in done.stderr
    _program(hooks / "gpushare-epilog", "sleep 30\n")
    started = time.monotonic()  # a hung ours is killed with its children, which would hold stdout open
    chain = subprocess.run([sys.executable, "-m", "gpushare.slurm_plugins.chain", "--site", site,
                            "--ours", str(hooks / "gpushare-epilog"), "--ours-timeout", "0.5"],
                           capture_output=True, timeout=30)
    assert chain.returncode == 0 and b"killed after 0.5 s" in chain.stderr
    assert time.monotonic() - started < 10


def test_a_sites_mail_program_is_wrapped_not_replaced(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    mail = _program(tmp_path / "site-mail", 'echo "$@" > "$0.args"; cat >> "$0.args"\n')
    out, _ = _install(tmp_path, f"MailProg={mail}\n", capsys)
    wrapper = tmp_path / "chains" / "gpushare-chain-MailProg"
    assert f"MailProg={wrapper}" in out
    done = _run(wrapper, "-s", "Slurm Job_id=7 Name=x Began, Queued time 00:00:01", "alice")
    assert done.returncode == 0  # a job that began: no summary to wait for; the site's mail goes out as is
    assert Path(mail + ".args").read_text().startswith("-s Slurm Job_id=7 Name=x Began")


def test_no_site_programs_no_wrappers(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out, hooks = _install(tmp_path, "ClusterName=t\nMailProg=/bin/true\nTaskProlog=/opt/gpushare/bin/gpushare-task-prolog\n",
                          capsys)
    assert list((tmp_path / "chains").iterdir()) == [] and f"TaskProlog={hooks}/gpushare-task-prolog" in out


def test_a_second_run_keeps_the_sites_program_found_in_its_wrapper(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    site = _program(tmp_path / "site-prolog", "exit 0\n")
    _install(tmp_path, f"TaskProlog={site}\n", capsys)
    wrapper = tmp_path / "chains" / "gpushare-chain-TaskProlog"
    (tmp_path / "slurm.conf").write_text(f"TaskProlog={wrapper}\n")  # as the admin pasted it
    assert gpushare_main(["slurm-config", "--config", str(EXAMPLE), "--hook-dir", str(tmp_path / "hooks"),
                          "--slurm-version", "22.05", "--slurm-conf", str(tmp_path / "slurm.conf"),
                          "--install-chains", str(tmp_path / "chains")]) == 0
    out = capsys.readouterr().out
    assert f"TaskProlog={wrapper}" in out and f"runs TaskProlog={site}" in out
    assert f"--site {site} " in wrapper.read_text()


def _logging_program(path: Path, log: Path, status: int = 0) -> str:
    return _program(path, f'echo "$(basename "$0")${{*:+ $*}}" >> {log}\nexit {status}\n')


def test_a_glob_slot_runs_each_file_as_slurmd_does(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """jobstats' layout: Prolog=<dir>/prolog.d/*.sh. slurmd runs every match, z before a, stopping at the first
    failure; the chain ran the pattern itself before (exit 127, node drained)."""
    log, scripts = tmp_path / "ran.log", tmp_path / "prolog.d"
    scripts.mkdir()
    for name in ("10-first.sh", "20-second.sh"):
        _logging_program(scripts / name, log)
    (scripts / "README").write_text("not a script\n")
    out, hooks = _install(tmp_path, f"Prolog={scripts}/*.sh\n", capsys)
    wrapper = tmp_path / "chains" / "gpushare-chain-Prolog"
    assert f"Prolog={wrapper}" in out and f"runs Prolog={scripts}/*.sh" in out
    _logging_program(hooks / "gpushare-prolog", log)

    done = _run(wrapper)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == ["20-second.sh", "10-first.sh", "gpushare-prolog"]

    log.unlink()  # the first failure ends the site's part with its status; ours still runs
    _logging_program(scripts / "20-second.sh", log, status=5)
    done = _run(wrapper)
    assert done.returncode == 5 and log.read_text().splitlines() == ["20-second.sh", "gpushare-prolog"]

    log.unlink()  # a pattern that matches nothing fails the slot before any file runs, as in slurmd
    for script in scripts.glob("*.sh"):
        script.unlink()
    done = _run(wrapper)
    assert done.returncode == 1 and b"matches no file" in done.stderr
    assert log.read_text().splitlines() == ["gpushare-prolog"]


def test_several_lines_of_a_slot_are_all_kept(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Slurm 24.05+: Epilog and EpilogSlurmctld on several lines, each running. slurmd's Epilog lines run in
    order and stop at a failure; every EpilogSlurmctld runs, the first failure giving the status."""
    log = tmp_path / "ran.log"
    a, b = _logging_program(tmp_path / "a", log, 3), _logging_program(tmp_path / "b", log)
    out, hooks = _install(tmp_path, f"Epilog={b}\nEpilog={a}\nEpilogSlurmctld={a}\nEpilogSlurmctld={b}\n"
                                    "TaskProlog=/first\nTaskProlog=/last\n", capsys)
    assert "2 lines: replace every Epilog= line" in out and "runs TaskProlog=/last:" in out
    _logging_program(hooks / "gpushare-epilog", log)
    _logging_program(hooks / "gpushare-epilog-slurmctld", log)
    done = _run(tmp_path / "chains" / "gpushare-chain-Epilog", "x")
    assert done.returncode == 3 and log.read_text().splitlines() == ["b x", "a x", "gpushare-epilog x"]
    log.unlink()
    done = _run(tmp_path / "chains" / "gpushare-chain-EpilogSlurmctld")
    assert done.returncode == 3 and log.read_text().splitlines() == ["a", "b", "gpushare-epilog-slurmctld"]

    conf = tmp_path / "slurm.conf"  # the admin pasted the chains in; a second run reads both programs back
    conf.write_text(f"Epilog={tmp_path}/chains/gpushare-chain-Epilog\n")
    assert gpushare_main(["slurm-config", "--config", str(EXAMPLE), "--hook-dir", str(hooks), "--slurm-version",
                          "22.05", "--slurm-conf", str(conf), "--install-chains", str(tmp_path / "chains")]) == 0
    assert f"runs Epilog={b} and {a} (2 lines" in capsys.readouterr().out


def test_without_python_the_sites_programs_still_run_as_slurm_runs_them(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    log, scripts = tmp_path / "ran.log", tmp_path / "epilog d"
    scripts.mkdir()
    for name in ("a.sh", "b.sh", "c.sh"):
        _logging_program(scripts / name, log, status=7 if name == "b.sh" else 0)
    _install(tmp_path, f"Epilog='{scripts}/*.sh'\n", capsys)
    wrapper = tmp_path / "chains" / "gpushare-chain-Epilog"
    wrapper.write_text(wrapper.read_text().replace(sys.executable, "/nonexistent/python3"))
    done = _run(wrapper, "arg")
    assert done.returncode == 7 and log.read_text().splitlines() == ["c.sh arg", "b.sh arg"]


def test_the_wrappers_python_ignores_the_working_directory(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """slurmd started from a directory holding a gpushare/ package (a clone): the chain's Python must still
    import the installed gpushare, or the site's program runs alone and ours never does."""
    site = _program(tmp_path / "site-prolog", "exit 0\n")
    _, hooks = _install(tmp_path, f"TaskProlog={site}\n", capsys)
    _program(hooks / "gpushare-task-prolog", 'echo ours > "$0.ran"\n')
    shadow = tmp_path / "clone" / "gpushare"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the clone, not the installed package')\n")
    done = subprocess.run([str(tmp_path / "chains" / "gpushare-chain-TaskProlog")], cwd=shadow.parent,
                          capture_output=True, timeout=60)
    assert done.returncode == 0 and (hooks / "gpushare-task-prolog.ran").read_text() == "ours\n", done.stderr


def test_the_printed_lines_say_restart_not_reconfigure(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out, _ = _install(tmp_path, "ClusterName=t\n", capsys)
    note = out.index("# Restart, do not reconfigure")
    assert note < out.index("GresTypes=gpu,shard") and "failed to parse tres weights str" in out[note:]
    assert "restart slurmctld, then every slurmd" in out[note:]


def test_the_wrappers_name_the_release_through_its_link(tmp_path: Path) -> None:
    """/opt/gpushare -> /opt/gpushare-0.1.0: what slurm-config writes names the link, so an upgrade or a rollback
    is one rename and the chains follow it (they once named the release and kept running it)."""
    from gpushare.slurm_plugins.slurm_config import chain_wrapper, stable_prefix

    release = tmp_path / "gpushare-0.1.0"
    (release / "bin").mkdir(parents=True)
    (release / "bin" / "python3").symlink_to(sys.executable)
    (release / "pyvenv.cfg").write_text(f"home = {Path(sys.executable).parent}\n")
    (tmp_path / "gpushare").symlink_to(release)
    assert stable_prefix(str(release)) == str(tmp_path / "gpushare") == stable_prefix(str(tmp_path / "gpushare"))
    assert stable_prefix(str(tmp_path / "elsewhere")) == str(tmp_path / "elsewhere")
    text = chain_wrapper("Epilog", ["/site/epilog"], f"{tmp_path}/gpushare/bin")
    assert f"exec {tmp_path}/gpushare/bin/python3 -I -m gpushare.slurm_plugins.chain" in text
    assert "gpushare-0.1.0" not in text


def test_a_comma_in_a_slot_is_part_of_the_file_name_as_in_slurm(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """No slot takes a comma list (slurm.conf(5)): `Epilog=/a,/b` is one path, which slurmd would fail to find;
    the chain and the doctor read it the same way instead of running two programs Slurm never would."""
    from gpushare.config import load_config
    from gpushare.slurm_plugins.controller_doctor import hook_slot_checks
    from gpushare.slurm_plugins.slurm_config import site_hooks

    a, b = _program(tmp_path / "a", "exit 0\n"), _program(tmp_path / "b", "exit 0\n")
    (tmp_path / "slurm.conf").write_text(f"Epilog={a},{b}\n")
    assert site_hooks(str(tmp_path / "slurm.conf")) == {"Epilog": [f"{a},{b}"]}
    [check] = hook_slot_checks(load_config(str(EXAMPLE)), str(tmp_path / "slurm.conf"), ("Epilog",))
    assert check.status == "problem" and f"{a},{b} matches no file" in check.detail


def _release(base: Path, version: str, log: Path) -> Path:
    """A virtualenv-shaped release: its python3 imports this gpushare, its gpushare-epilog says its version."""
    import site
    import sysconfig

    release = base / f"gpushare-{version}"
    (release / "bin").mkdir(parents=True)
    (release / "bin" / "python3").symlink_to(sys.executable)
    (release / "pyvenv.cfg").write_text(f"home = {Path(sys._base_executable).parent}\n")  # type: ignore[attr-defined]
    packages = release / Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)
    packages.mkdir(parents=True)
    (packages / "dev.pth").write_text(f"import site; site.addsitedir({site.getsitepackages()[0]!r})\n")
    _program(release / "bin" / "gpushare-epilog", f'echo "ours {version}" >> {log}\n')
    return release


def test_an_upgrade_and_a_rollback_are_one_rename_for_a_chain(tmp_path: Path) -> None:
    """docs/deployment.md, Upgrade: /opt/gpushare links the release in use, the chain names the link. Switching
    the link runs the other release's program at once, back and forth; removing the old release after the
    switch leaves the chain whole (it once named the release: after the removal the site's program ran alone)."""
    import os

    from gpushare.slurm_plugins.slurm_config import install_chains, stable_prefix

    log = tmp_path / "ran.log"
    site = _logging_program(tmp_path / "site-epilog", log)
    old, new, link = _release(tmp_path, "0.1.0", log), _release(tmp_path, "0.2.0", log), tmp_path / "gpushare"
    link.symlink_to(old)
    hook_dir = os.path.join(stable_prefix(str(old)), "bin")  # slurm-config's default, run from release 0.1.0
    chain = install_chains({"Epilog": [site]}, hook_dir, tmp_path)["Epilog"]
    assert "0.1.0" not in Path(chain).read_text()

    def switch(to: Path) -> list[str]:
        (tmp_path / "gpushare.next").symlink_to(to)
        (tmp_path / "gpushare.next").rename(link)  # mv -T: one rename
        if log.exists():
            log.unlink()
        done = subprocess.run([chain], capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return log.read_text().splitlines()

    assert switch(old) == ["site-epilog", "ours 0.1.0"]
    assert switch(new) == ["site-epilog", "ours 0.2.0"]  # upgrade
    assert switch(old) == ["site-epilog", "ours 0.1.0"]  # rollback
    assert switch(new) == ["site-epilog", "ours 0.2.0"]
    import shutil

    shutil.rmtree(old)  # the old release removed once the new one has run a while
    assert switch(new) == ["site-epilog", "ours 0.2.0"]
