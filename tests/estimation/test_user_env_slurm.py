"""On real Slurm: jobs without an estimate whose batch script sets up an environment get their asynchronous
estimate computed *in* that environment, by the real gpu-estimate, as the user.

The environments are real virtualenvs (made from Debian's Python, so the same interpreter exists inside the
newer Slurm releases' chroots) that reach a PyTorch through a ``.pth`` line — the cached PyTorch 2.4.1 venv of
``make python-envs`` for the sourced venv (this project's 2.13 without it), this project's for the conda-style
one — and each hold a package nothing else has: the training script imports it, so an estimate made anywhere
else fails. One is entered with ``source venv/bin/activate``, one with a conda-style ``activate`` script; a
third batch script sets up its environment in a way that fails, and the fallback names the line; a fourth
loads an Lmod module that gives PyTorch 2.14.1 (Debian's lmod, on the host and in the newer releases' chroots).
"""

from __future__ import annotations

import os
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from gpushare.slurm.gres_request import plain_gres
from gpushare.slurm_plugins.decision import parse_record
from devcluster.local_cluster import LOGIN_TEST_USER, LocalCluster

pytestmark = [pytest.mark.slurm, pytest.mark.torch]

BASE_PYTHON = "/usr/bin/python3"
TRAIN = """import torch
import torch.nn as nn
import {package}  # only the job's environment has it

model = nn.Sequential(nn.Linear(256, {package}.WIDTH), nn.ReLU(), nn.Linear({package}.WIDTH, 10)).cuda()
opt = torch.optim.Adam(model.parameters())
for step in range(3):
    loss = model(torch.randn(32, 256, device="cuda")).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
# The job itself has no GPU software: it only has to start and exit 0 once released.
STUB = "python() { true; }\npython3() { true; }\nsrun() { true; }\n"


PYTHON_ENVS = Path(os.environ.get("GPUSHARE_PYTHON_ENVS", "/var/cache/gpushare/python-envs"))
OLDEST_TORCH = PYTHON_ENVS / "torch-2.4.1"  # `make python-envs`; this project's PyTorch without it


def torch_site() -> tuple[str, str]:
    """The site-packages a test venv borrows its PyTorch from, and that PyTorch's version."""
    import torch

    if (OLDEST_TORCH / "bin" / "python").exists():
        return next(str(p) for p in (OLDEST_TORCH / "lib").glob("python3*/site-packages")), "2.4.1"
    return sysconfig.get_paths()["purelib"], torch.__version__


def make_env(path: Path, package: str, borrowed: str | None = None) -> Path:
    """A venv that borrows a PyTorch (``borrowed``: a site-packages; default this project's) and holds
    ``package``; returns its bin directory."""
    subprocess.run([BASE_PYTHON, "-m", "venv", "--without-pip", str(path)], check=True)
    site = next((path / "lib").glob("python3*/site-packages"))
    (site / "borrowed_torch.pth").write_text((borrowed or sysconfig.get_paths()["purelib"]) + "\n")
    (site / package).mkdir()
    (site / package / "__init__.py").write_text("WIDTH = 384\n")
    return path / "bin"


@pytest.fixture(scope="module")
def envs(est_root: Path) -> dict[str, Path]:
    venv = make_env(est_root / "venvs" / "llm", "only_in_venv", torch_site()[0])
    conda = make_env(est_root / "conda" / "envs" / "proj", "only_in_conda")
    activate = est_root / "conda" / "bin" / "activate"  # what `source /opt/conda/bin/activate proj` runs
    activate.parent.mkdir(parents=True)
    activate.write_text(f'CONDA_PREFIX="{est_root}/conda/envs/$1"\nexport CONDA_PREFIX CONDA_DEFAULT_ENV="$1"\n'
                        'export PATH="$CONDA_PREFIX/bin:$PATH"\n')
    return {"venv": venv, "conda": conda, "conda_root": est_root / "conda"}


def submit(cluster: LocalCluster, work: Path, user: Any, package: str, body: str) -> int:
    """Submit ``body`` (which runs train.py) from a directory of its own (``work/<name>``) holding train.py."""
    work = work / f"job{len(list(work.iterdir()))}"
    work.mkdir()
    os.chown(work, user.pw_uid, user.pw_gid)
    train = work / "train.py"
    train.write_text(TRAIN.format(package=package))
    os.chown(train, user.pw_uid, user.pw_gid)
    proc = subprocess.run(cluster.user_argv(LOGIN_TEST_USER, ["sbatch", "--parsable", "--gres=gpu:1", "-D", str(work),
                                                             "-o", str(work / "job-%j.out")]),
                          input="#!/bin/bash\n" + body, capture_output=True, text=True, env=cluster.env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().split(";")[0])


def released(cluster: LocalCluster, job_id: int, timeout_s: float = 180) -> dict[str, Any]:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = cluster.client.job(job_id)
        assert found is not None
        record = parse_record(found.admin_comment) or {}
        if record.get("decision") != "estimating":
            return record
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still held after {timeout_s} s")


def test_estimates_are_made_in_each_jobs_own_environment(est_cluster, work, user, envs, helpers):
    problem = helpers.user_can_run_estimator(est_cluster)
    if problem:
        pytest.skip(problem)
    import torch

    venv_torch = torch_site()[1]
    venv_job = submit(est_cluster, work, user, "only_in_venv",
                      f"source {envs['venv']}/activate\nexport OMP_NUM_THREADS=1\n{STUB}python train.py\n")
    conda_job = submit(est_cluster, work, user, "only_in_conda",
                       f"source {envs['conda_root']}/bin/activate proj\n{STUB}srun python3 train.py\n")
    broken_job = submit(est_cluster, work, user, "only_in_venv",
                        f"set -e\nsource {envs['venv']}/nonexistent\n{STUB}python train.py\n")
    for job_id, env in ((venv_job, envs["venv"]), (conda_job, envs["conda"])):
        record = released(est_cluster, job_id)
        assert record["decision"] == "shared" and record["src"] == "async", record
        assert plain_gres(record["new"]) == "shard:2"  # 0.5 GiB with the CUDA context, + 1 GiB margin
        python, version = ("python", venv_torch) if job_id == venv_job else ("python3", torch.__version__)
        assert record["python"].startswith(f"{env}/{python} (Python 3.") and f"PyTorch {version}" in \
            record["python"], record
    record = released(est_cluster, broken_job)
    assert record["decision"] == "exclusive" and plain_gres(record["new"]) == "shard:40"
    assert "environment could not be reproduced: batch script line 3" in record["why"], record
    for job_id in (venv_job, conda_job):
        assert est_cluster.wait_job(job_id).state == "COMPLETED"


OTHER_TORCH_ENV = Path(os.environ.get("GPUSHARE_PYTHON_ENVS", "/var/cache/gpushare/python-envs")) / "torch-2.14.1"
MODULE_FILE = """-- A site's PyTorch module: its interpreter on PATH, its extra packages on PYTHONPATH.
prepend_path("PATH", "{env}/bin")
prepend_path("PYTHONPATH", "{packages}")
"""


def test_a_module_gives_the_training_another_pytorch(est_cluster, work, user, est_root, helpers):
    """`module load torch/2.14.1` (Debian's Lmod) puts another PyTorch's venv on PATH and a package on
    PYTHONPATH; the estimate runs under that PyTorch and imports that package."""
    root = Path(est_cluster.runtime.root or "/")  # where the job runs: the host, or the release's chroot
    if not (root / "etc/profile.d/lmod.sh").exists():
        pytest.skip(f"Debian's lmod is not installed in {root} ('make setup' and the chroot build install it)")
    if not (OTHER_TORCH_ENV / "bin" / "python").exists():
        pytest.skip(f"{OTHER_TORCH_ENV} missing: 'make python-envs' builds it")
    problem = helpers.user_can_run_estimator(est_cluster)
    if problem:
        pytest.skip(problem)
    packages = est_root / "module-packages"
    (packages / "only_in_module").mkdir(parents=True)
    (packages / "only_in_module" / "__init__.py").write_text("WIDTH = 384\n")
    modulefile = est_root / "modulefiles" / "torch" / "2.14.1.lua"
    modulefile.parent.mkdir(parents=True)
    modulefile.write_text(MODULE_FILE.format(env=OTHER_TORCH_ENV, packages=packages))
    job_id = submit(est_cluster, work, user, "only_in_module",
                    f"module use {est_root}/modulefiles\nmodule load torch/2.14.1\n{STUB}python train.py\n")
    record = released(est_cluster, job_id)
    assert record["decision"] == "shared" and record["src"] == "async" and plain_gres(record["new"]) == "shard:2", record
    assert record["python"].startswith(f"{OTHER_TORCH_ENV}/bin/python (Python 3.") and "PyTorch 2.14.1" in \
        record["python"], record
    assert est_cluster.wait_job(job_id).state == "COMPLETED"
