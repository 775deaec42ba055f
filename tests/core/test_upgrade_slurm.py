"""docs/deployment.md's install, upgrade and rollback, wheel to wheel, with a job running across the switch.

Two wheels of this package are built (the tree as it is, and the tree with its version bumped), and the page's
own commands run, read from the page itself (its install, controller and upgrade blocks, and the rollback's
switch): a virtualenv per release, ``/opt/gpushare`` a link to the one in use (here under a temporary folder
standing for /opt, and the cluster's folder standing for /etc/slurm), ``slurm-config --install-lua
--install-hooks --install-chains`` from the installed release, gpushare-submitd started through the link. A
step of the page this test does not know fails it: the test follows the page or breaks with it.

What is checked: a shared job started before the upgrade finishes after it, its node never drained; after the
switch the hook wrappers' Python imports the new release, gpushare-submitd logs the new release at its start,
and a new job is rewritten by the new release's Lua module; the rollback gives the old release back the same
way. The agent is not part of this cluster (``systemctl restart gpushare-agent`` is the one step skipped); the
agent's restore across a restart has its own tests (docs/agent.md). Host Slurm only: a virtualenv made with
this host's Python does not run inside the chroots of the other releases.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest

from devcluster import slurm_runtime
from devcluster.local_cluster import LocalCluster, missing_requirements
from devcluster.processes import scaled
from gpushare.slurm.gres_request import plain_gres

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deployment.md"
HOOK_KEYS = ("Prolog", "Epilog", "TaskProlog", "TaskEpilog", "EpilogSlurmctld", "MailProg", "JobSubmitPlugins")


def _sh_blocks(section: str) -> list[list[str]]:
    """The ```sh blocks of one section of the page, as commands: continuation lines joined, comments dropped."""
    text = DOC.read_text().split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", "", block)
        commands = [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines()]
        blocks.append([c for c in commands if c and not c.startswith("#")])
    return blocks


def _copy_sources(target: Path, version: str) -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target.mkdir()
    text = (ROOT / "pyproject.toml").read_text()
    (target / "pyproject.toml").write_text(text.replace(f'version = "{data["project"]["version"]}"',
                                                        f'version = "{version}"', 1))
    shutil.copy(ROOT / "README.md", target / "README.md")
    for folder in set(data["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(ROOT / folder, target / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _wheel(work: Path, version: str) -> Path:
    """The page's build line (``python3 -m pip wheel --no-deps -w dist .``), offline: the build backend of this
    virtualenv rather than a freshly downloaded one."""
    source = work / f"src-{version}"
    _copy_sources(source, version)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(work / "dist"), "."], cwd=source, check=True, capture_output=True, timeout=scaled(300))
    return next((work / "dist").glob(f"slurm_gpushare-{version}-py3-none-any.whl"))


class Page:
    """Runs the page's commands with /opt, /etc/slurm, the wheels and the page's release numbers mapped here."""

    def __init__(self, opt: Path, cluster: LocalCluster, wheels: dict[str, Path], versions: dict[str, str]) -> None:
        self.opt, self.cluster, self.wheels, self.versions = opt, cluster, wheels, versions
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSHARE_", "PYTHON"))}
        self.env["SLURM_CONF"] = str(cluster.conf)  # gpushare.toml beside it: found as on a site, unnamed
        self.printed = self.doctor = ""

    def local(self, command: str) -> str:
        for page_version, ours in self.versions.items():
            command = command.replace(f"/tmp/slurm_gpushare-{page_version}-py3-none-any.whl", str(self.wheels[ours]))
            command = command.replace(f"/opt/gpushare-{page_version}", f"/opt/gpushare-{ours}")
        command = re.sub(r"(?<![\w/.-])/opt/", f"{self.opt}/", command)
        command = command.replace("/etc/slurm", str(self.cluster.base / "etc"))
        if command.startswith("gpushare "):  # /usr/local/bin/gpushare: a link into /opt/gpushare/bin
            command = f"{self.opt}/gpushare/bin/{command}"
        return command

    def run(self, command: str) -> None:
        """One line of the page: the shell's, or the service step it names, or a failure for an unknown one."""
        if command.startswith("ln -sf /opt/gpushare/bin/gpushare*"):
            return  # links into this host's /usr/local/bin: gpushare is named through /opt/gpushare/bin here
        if command == "systemctl restart gpushare-agent":
            return  # no agent in this cluster (the module's docstring)
        if command in ("systemctl restart gpushare-submitd", "systemctl enable --now gpushare-submitd "
                       "gpushare-oom-resume.timer"):
            self.cluster.stop_process("submitd")
            self.cluster.start_submitd()
            return
        if command.startswith("cp etc/systemd/"):
            return  # the units: gpushare-submitd runs as the cluster's own process, through the same link
        if "pip install" in command and "[node]" not in command:
            return  # the controller's and the login node's extras: this host is a GPU node (a superset)
        known = ("/usr/bin/python3 -m venv ", "ln -sfn ", "gpushare ", "/opt/gpushare")
        if not command.startswith(known):
            pytest.fail(f"docs/deployment.md has a step this test does not know: {command}")
        done = subprocess.run(["bash", "-ec", self.local(command)], capture_output=True, text=True, env=self.env,
                              timeout=scaled(600))
        assert done.returncode == 0 or command.endswith("doctor"), (command, done.stdout[-2000:], done.stderr[-2000:])
        if "slurm-config" in command:
            self.printed = done.stdout
        if command.endswith("doctor"):
            self.doctor = done.stdout

    def paste_hook_lines(self) -> None:
        """The printed hook lines into slurm.conf (each replaces its key's lines), then scontrol reconfigure."""
        lines = self.cluster.conf.read_text().splitlines()
        for new in (line for line in self.printed.splitlines() if line.split("=", 1)[0] in HOOK_KEYS):
            key = new.split("=", 1)[0]
            lines = [line for line in lines if line.split("=", 1)[0] != key] + [new]
        self.cluster.conf.write_text("\n".join(lines) + "\n")
        self.cluster.client.run("scontrol", "reconfigure")


def _release_of_hooks(etc: Path) -> set[str]:
    """The release each hook wrapper runs now: a chain wrapper execs the link's python3, a hook wrapper runs the
    link's entry point, whose interpreter is its #! line."""
    found = set()
    for wrapper in [*(etc / "gpushare-hooks").iterdir(), *(etc / "gpushare-chains").glob("*")]:
        lines = wrapper.read_text().splitlines()
        python = next((line.split()[1] for line in lines if line.startswith("exec ") and " -I " in line), None)
        if python is None:
            program = shlex.split(next(line for line in lines if line.endswith(' "$@"') and line[:1] in "'/"))[0]
            python = Path(program).read_text().splitlines()[0].removeprefix("#!").split()[0]
        found.add(subprocess.run([python, "-I", "-c", "from gpushare.config import installed_version as v; "
                                  "print(v())"], capture_output=True, text=True, timeout=60, check=True).stdout.strip())
    return found


def _wait_log(path: Path, text: str, times: int = 1) -> None:
    deadline = time.monotonic() + scaled(60)
    while not (path.exists() and path.read_text().count(text) >= times):
        assert time.monotonic() < deadline, f"{path} never said {text!r} {times} time(s)"
        time.sleep(0.2)


@pytest.mark.version_sensitive("runs on the host's release only: the page's virtualenvs are made with the host's "
                                "/usr/bin/python3, which does not run inside a chroot release (skips there)")
def test_wheel_to_wheel_upgrade_and_rollback_with_a_job_running() -> None:
    if slurm_runtime.requested_version() != slurm_runtime.HOST:
        pytest.skip("a virtualenv of this host's Python does not run inside another release's chroot")
    problem = missing_requirements()
    if problem:
        pytest.skip(problem)
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("no system /usr/bin/python3 to make the page's virtualenvs with")
    old = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    new = f"{old}.post1"
    install, controller = _sh_blocks("Install: a wheel built from the clone, a virtualenv on each host")[1:3]
    [upgrade] = _sh_blocks("Upgrade, rollback and uninstall")[:1]
    page_old = re.search(r"/opt/gpushare-(\S+)", install[0]).group(1)  # type: ignore[union-attr]
    page_new = re.search(r"/opt/gpushare-(\S+)", upgrade[0]).group(1)  # type: ignore[union-attr]
    rollback = re.search(r"\*\*Rollback\*\*: the same switch back \(`(ln -sfn /opt/gpushare-\S+ /opt/gpushare\.next) "
                         r"&& mv -T …`\)", DOC.read_text())
    assert rollback, "docs/deployment.md's rollback no longer gives the switch back"
    switch = next(c for c in upgrade if c.startswith("ln -sfn "))

    work = Path(tempfile.mkdtemp(prefix="gpushare-upgrade-", dir="/tmp"))
    os.chmod(work, 0o755)  # slurm (EpilogSlurmctld) and the job's user run the link's Python
    opt = work / "opt"
    opt.mkdir()
    cluster = LocalCluster(work / "cluster", bin_dir=str(opt / "gpushare" / "bin"), with_hook=False,
                           with_submitd=False)
    try:
        wheels = {old: _wheel(work, old), new: _wheel(work, new)}
        page = Page(opt, cluster, wheels, {page_old: old, page_new: new})
        for command in install:
            page.run(command)
        cluster.start()
        # the site's slurm.conf before gpushare: the test cluster's own hook lines go (slurm-config would chain them)
        cluster.conf.write_text("".join(line + "\n" for line in cluster.conf.read_text().splitlines()
                                        if line.split("=", 1)[0] not in HOOK_KEYS[:5]))
        for command in controller:
            page.run(command)
            if "slurm-config" in command:
                page.paste_hook_lines()
        etc = cluster.base / "etc"
        assert _release_of_hooks(etc) == {old}
        submitd_log = cluster.base / "log" / "submitd.log"
        _wait_log(submitd_log, f"slurm-gpushare {old};")
        _wait_log(submitd_log, "listening on")

        jobs = cluster.base / "jobs"
        jobs.mkdir(mode=0o777)
        os.chmod(jobs, 0o777)
        flag = jobs / "go-on"
        waiting = (f"#!/bin/sh\n#GPUSHARE mem=4G\nn=0\nwhile [ ! -e {flag} ] && [ $n -lt 3000 ]; do sleep 0.1; "
                   "n=$((n+1)); done\n")
        running, _ = cluster.client.sbatch("-D", str(jobs), "-o", "/dev/null", "--gres=gpu:1", script=waiting)
        deadline = time.monotonic() + scaled(60)
        while cluster.client.job(running).state != "RUNNING":  # type: ignore[union-attr]
            assert time.monotonic() < deadline, cluster.client.job(running)
            time.sleep(0.2)
        assert plain_gres(cluster.client.job(running).tres_per_node).startswith("shard:")  # type: ignore[union-attr]

        for command in upgrade:  # the page's upgrade, as written
            page.run(command)
        assert f"(gpushare {new})" in page.doctor, page.doctor  # the doctor of the new release
        page.paste_hook_lines()
        assert os.path.realpath(opt / "gpushare") == str(opt / f"gpushare-{new}")
        assert _release_of_hooks(etc) == {new}
        _wait_log(submitd_log, f"slurm-gpushare {new};")
        _wait_log(submitd_log, "listening on", times=2)
        flag.touch()
        assert cluster.wait_job(running, timeout_s=scaled(60)).state == "COMPLETED"
        after, _ = cluster.client.sbatch("-D", str(jobs), "-o", "/dev/null", "--gres=gpu:1", script=waiting)
        assert cluster.wait_job(after, timeout_s=scaled(60)).state == "COMPLETED"
        assert plain_gres(cluster.client.job(after).tres_per_node).startswith("shard:")  # type: ignore[union-attr]

        # rollback: the same switch back, the services restarted, the older release's own Lua module
        flag.unlink()
        back, _ = cluster.client.sbatch("-D", str(jobs), "-o", "/dev/null", "--gres=gpu:1", script=waiting)
        page.run(switch.replace(f"gpushare-{page_new} ", f"gpushare-{page_old} "))
        assert rollback.group(1) in switch.replace(f"gpushare-{page_new} ", f"gpushare-{page_old} ")
        page.run("systemctl restart gpushare-submitd")
        page.run(f"/opt/gpushare-{page_old}/bin/gpushare slurm-config --install-lua /etc/slurm")
        (etc / "job_submit.lua").touch()
        assert os.path.realpath(opt / "gpushare") == str(opt / f"gpushare-{old}")
        assert _release_of_hooks(etc) == {old}
        _wait_log(submitd_log, f"slurm-gpushare {old};", times=2)
        _wait_log(submitd_log, "listening on", times=3)
        flag.touch()
        assert cluster.wait_job(back, timeout_s=scaled(60)).state == "COMPLETED"
        final, _ = cluster.client.sbatch("-D", str(jobs), "-o", "/dev/null", "--gres=gpu:1", script=waiting)
        assert cluster.wait_job(final, timeout_s=scaled(60)).state == "COMPLETED"
        assert plain_gres(cluster.client.job(final).tres_per_node).startswith("shard:")  # type: ignore[union-attr]
        state = cluster.client.node_states().get("n1", "")
        assert "drain" not in state and "down" not in state, state
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
