"""docs/deployment.md stays true: the install path it gives works, and it names what exists.

The slow test does what the page tells a site to do: build the wheel from (a copy of) this repository with
``pip wheel --no-deps``, install it into a fresh virtualenv with the GPU node's extras (pip as configured on
this machine: its index and constraints), and run the installed entry points: ``gpushare --help``,
``gpushare doctor``, ``gpushare slurm-config --install-lua`` (the shim is package data), a hook, and the two
services refusing to start without a configuration file. PyTorch must not come with the GPU node's extras.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deployment.md"
BASE_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_page_names_every_unit_entry_point_and_role_extra() -> None:
    text = DOC.read_text()
    units = sorted(p.name for p in (ROOT / "etc" / "systemd").iterdir())
    timers = {u.removesuffix(".timer") for u in units if u.endswith(".timer")}
    for unit in units:  # a timer's service is named by its timer
        if not (unit in text or (unit.endswith(".service") and unit.removesuffix(".service") in timers)):
            pytest.fail(f"docs/deployment.md does not say where {unit} runs")
    for script in _pyproject()["project"]["scripts"]:
        assert f"`{script}" in text, f"docs/deployment.md does not say where {script} runs"
    extras = set(_pyproject()["project"]["optional-dependencies"])
    named = set(re.findall(r"`(\w+)`", text.split("## Install", 1)[0])) & (extras | {"none"})
    assert {"node", "estimator"} <= named and named - {"none"} <= extras
    readme = (ROOT / "README.md").read_text()
    assert "pip install 'slurm-gpushare[node]'" not in readme  # on no index: the wheel line replaces it
    assert "python3 -m pip wheel --no-deps -w dist ." in readme and "python3 -m pip wheel --no-deps -w dist ." in text


def _copy_sources(target: Path) -> None:
    """What the wheel is built from, outside the checkout: a build writes build/ and *.egg-info beside it."""
    data = _pyproject()
    target.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, target / name)
    for folder in set(data["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(ROOT / folder, target / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


@pytest.mark.slow
def test_wheel_from_the_clone_installs_and_runs_on_a_gpu_node(tmp_path: Path) -> None:
    source = tmp_path / "src"
    _copy_sources(source)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), "."], cwd=source,
                   check=True, capture_output=True, timeout=300)
    [wheel] = dist.glob("slurm_gpushare-*-py3-none-any.whl")
    venv = tmp_path / "opt-gpushare-0.1.0"  # the page's layout: a virtualenv per release, a link to the one in use
    subprocess.run([BASE_PYTHON, "-m", "venv", str(venv)], check=True, timeout=120)
    link = tmp_path / "opt-gpushare"
    link.symlink_to(venv)
    install = subprocess.run([str(link / "bin" / "python"), "-m", "pip", "install", "-q", f"{wheel}[node]"],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    bin_dir = link / "bin"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSHARE_", "SLURM_"))}
    env.update({"SLURM_CONF": str(tmp_path / "etc-slurm" / "slurm.conf"), "PYTHONPATH": ""})

    def run(*argv: str, **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=kw.pop("env", env),
                              cwd=tmp_path, timeout=120, **kw)  # type: ignore[call-overload]

    probe = run(bin_dir / "python", "-c", "import importlib.util as u, gpushare; "
                "print(u.find_spec('torch') is None, u.find_spec('pynvml') is not None, "
                "u.find_spec('prometheus_client') is not None, gpushare.__file__)")
    assert probe.stdout.split()[:3] == ["True", "True", "True"], probe.stdout + probe.stderr
    assert str(tmp_path) in probe.stdout  # the installed copy, not this checkout
    helped = run(bin_dir / "gpushare", "--help")
    assert helped.returncode == 0 and "doctor" in helped.stdout
    assert run(bin_dir / "gpushare", "doctor", "--help").returncode == 0

    # no gpushare.toml anywhere it looks: the hook goes on and says so; the services refuse
    if Path("/etc/slurm/gpushare.toml").exists():
        pytest.skip("/etc/slurm/gpushare.toml exists on this host: the missing-file behaviour cannot be shown")
    hook = run(bin_dir / "gpushare-prolog")
    assert hook.returncode == 0 and "no gpushare.toml (tried" in hook.stderr, hook.stderr
    agent = run(bin_dir / "gpushare-agent", "--node", "n1")
    assert agent.returncode == 2 and "--defaults" in agent.stdout, agent.stdout + agent.stderr
    submitd = run(bin_dir / "gpushare-submitd", "--socket", tmp_path / "s.sock")
    assert submitd.returncode == 2 and "--defaults" in submitd.stderr, submitd.stderr

    site = tmp_path / "etc-slurm" / "gpushare.toml"  # beside $SLURM_CONF: found without being named
    site.parent.mkdir()
    site.write_text('version = 1\n[[nodes]]\nnames = "g[1-2]"\ngpu = "a100-40gb"\ncount = 2\n')
    doctor = run(bin_dir / "gpushare", "doctor", "--no-slurm", "--node", "g1=127.0.0.1", "--timeout", "1")
    assert doctor.stdout.startswith("config") and str(site) in doctor.stdout, doctor.stdout + doctor.stderr
    lua = tmp_path / "lua"
    config = run(bin_dir / "gpushare", "slurm-config", "--install-lua", lua, "--slurm-version", "22.05")
    assert config.returncode == 0, config.stderr
    assert f"Prolog={bin_dir}/gpushare-prolog" in config.stdout and (lua / "job_submit.lua").is_file()
    # the chains, too, name the link and not the release (an upgrade is one rename; docs/deployment.md)
    (site.parent / "slurm.conf").write_text(f"Epilog={tmp_path}/epilog.d/*.sh\n")
    chains = run(bin_dir / "gpushare", "slurm-config", "--install-chains", tmp_path / "chains", "--slurm-version",
                 "22.05")
    assert chains.returncode == 0 and f"Epilog={tmp_path}/chains/gpushare-chain-Epilog" in chains.stdout, chains.stderr
    wrapper = (tmp_path / "chains" / "gpushare-chain-Epilog").read_text()
    assert f"exec {bin_dir}/python3 -I -m gpushare.slurm_plugins.chain --slot Epilog" in wrapper, wrapper
    assert str(venv) not in wrapper and f"GPUSHARE_CONFIG={site}" in wrapper
