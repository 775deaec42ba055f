"""A hook whose Python cannot start must not fail the hook: slurmd drains a node whose Prolog fails.

Our programs fail open once Python runs; a console script whose interpreter is gone (a virtualenv removed or
half replaced during an upgrade) fails before any of our code. Measured here on a real Slurm: such a
Prolog named directly in slurm.conf drains the node; the same program behind the wrapper
``gpushare slurm-config --install-hooks DIR`` writes lets the job run and the node stay up. The chain
wrapper (``--install-chains``) runs the site's program alone when our Python cannot start, its status kept.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devcluster.local_cluster import LocalCluster
from devcluster.processes import scaled
from gpushare.slurm_plugins.slurm_config import hook_wrapper, install_chains, install_hooks

BROKEN = "#!/nonexistent/gpushare-venv/bin/python\nimport sys\nsys.exit(0)\n"  # what a removed virtualenv leaves


def _broken_hook_dir(base: Path) -> Path:
    """A virtualenv's bin directory whose interpreter is gone: every entry point fails with exit 127."""
    directory = base / "broken-venv" / "bin"
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("gpushare-prolog", "gpushare-task-prolog"):
        (directory / name).write_text(BROKEN)
        (directory / name).chmod(0o755)
    return directory


def _set_prolog(cluster: LocalCluster, program: str) -> None:
    conf = "\n".join(f"Prolog={program}" if line.startswith("Prolog=") else line
                     for line in cluster.conf.read_text().splitlines()) + "\n"
    cluster.conf.write_text(conf)
    cluster.client.run("scontrol", "reconfigure")
    time.sleep(2)


def _state(cluster: LocalCluster) -> str:
    return cluster.client.node_states().get("n1", "")


@pytest.mark.slurm
def test_a_prolog_that_cannot_start_python_does_not_drain_the_node(make_cluster, tmp_path: Path) -> None:
    cluster: LocalCluster = make_cluster(with_submitd=False, with_hook=False)
    broken = _broken_hook_dir(cluster.base)
    os.chmod(tmp_path, 0o755)
    script = "#!/bin/sh\necho ran\n"

    _set_prolog(cluster, str(broken / "gpushare-prolog"))  # the entry point itself, as slurm.conf named it before
    first, _ = cluster.client.sbatch("-D", str(tmp_path), "-o", "/dev/null", script=script)
    deadline = time.monotonic() + scaled(60)
    while "drain" not in _state(cluster):
        assert time.monotonic() < deadline, f"node state {_state(cluster)!r}: the broken Prolog did not drain it"
        time.sleep(0.5)
    cluster.client.run("scancel", str(first))
    cluster.client.run("scontrol", "update", "nodename=n1", "state=resume")

    wrappers = install_hooks(["Prolog"], str(broken), cluster.base / "bin")
    _set_prolog(cluster, wrappers["Prolog"])
    job, _ = cluster.client.sbatch("-D", str(tmp_path), "-o", str(tmp_path / "job-%j.out"), script=script)
    assert cluster.wait_job(job).state == "COMPLETED"
    assert (tmp_path / f"job-{job}.out").read_text() == "ran\n"
    assert "drain" not in _state(cluster) and "down" not in _state(cluster)


def test_the_hook_wrapper_passes_output_and_always_succeeds(tmp_path: Path) -> None:
    broken = _broken_hook_dir(tmp_path)
    wrapper = tmp_path / "gpushare-hook-TaskProlog"
    wrapper.write_text(hook_wrapper("TaskProlog", str(broken)))
    wrapper.chmod(0o755)
    done = subprocess.run([str(wrapper)], capture_output=True, text=True, timeout=10)
    assert done.returncode == 0  # the interpreter is gone: exit 127 underneath
    (broken / "gpushare-task-prolog").write_text("#!/bin/sh\necho export SEEN=\"$1\"\nexit 3\n")
    done = subprocess.run([str(wrapper), "arg one"], capture_output=True, text=True, timeout=10)
    assert (done.returncode, done.stdout) == (0, "export SEEN=arg one\n")


def test_the_chain_runs_the_sites_program_alone_when_our_python_cannot_start(tmp_path: Path, monkeypatch) -> None:
    site = tmp_path / "site-prolog"
    site.write_text("#!/bin/sh\necho \"site ran with $1\"\nexit 4\n")
    site.chmod(0o755)
    monkeypatch.setattr(sys, "executable", "/nonexistent/gpushare-venv/bin/python")
    chain = install_chains({"Prolog": str(site)}, str(_broken_hook_dir(tmp_path)), tmp_path)["Prolog"]
    done = subprocess.run([chain, "x"], capture_output=True, text=True, timeout=10)
    assert (done.returncode, done.stdout) == (4, "site ran with x\n")  # the site's program and status, as before
