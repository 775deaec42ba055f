"""The Prolog's driver backend (per-cgroup device memory limits, gpushare.node.hardcap) over the simulated
driver, on a real directory tree laid out as Slurm's cgroup v2 hierarchy, and the Epilog undoing it."""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpushare.config import parse_config
from gpushare.epilog.slurmd_epilog import close_job
from gpushare.gpus import GiB
from gpushare.gres.sim_backend import SimBackend
from gpushare.node import hardcap
from gpushare.prolog.slurmd_prolog import register

FRACTION = {"GPUSHARE_CAPS_MODE": "fraction", "GPUSHARE_MEM_LIMIT_MIB": "2048", "GPUSHARE_MEMORY_FRACTION": "0.05"}
OOM = 2


def cgroup_tree(root: Path, *jobs: str) -> Path:
    """``root`` as a cgroup v2 mount with slurmstepd's jobs in it (dmem enabled down to each job)."""
    (root / "cgroup.controllers").parent.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids dmem\n")
    for job in jobs:
        task = root / "system.slice" / "slurmstepd.scope" / f"job_{job}" / "step_0" / "user" / "task_0"
        task.mkdir(parents=True)
        (task.parents[2] / "dmem.max").write_text("max\n")
    return root


def sim_node(clock: Callable[[], float], *limits: str) -> SimBackend:
    return SimBackend.from_scenario({"version": 1, "gpus": [{"model": "h100-80gb", "memory_limits": m} for m in limits]},
                                    clock=clock)


@pytest.fixture
def roots(tmp_path: Path) -> tuple[str, str]:
    return str(tmp_path / "hardcap"), str(cgroup_tree(tmp_path / "cg", "51", "52"))


def test_driver_limits_cap_the_job_and_the_epilog_clears_them(clock, roots: tuple[str, str]) -> None:
    root, cg = roots
    sim = sim_node(clock, "dmem", "dmem")
    assert hardcap.apply("51", 1000, [0, 1], FRACTION, "driver", root, backend=sim, cgroup_root=cg) == "driver"
    job_cg = f"{cg}/system.slice/slurmstepd.scope/job_51"
    task = f"{job_cg}/step_0/user/task_0"
    assert [sim.memory_limit(i, job_cg).hard for i in (0, 1)] == [2 * GiB, 2 * GiB]
    assert sim.allocate(0, 300, 2 * GiB, task) == 0 and sim.allocate(0, 301, 1 << 20, task) == OOM  # at its share
    assert sim.allocate(0, 400, 8 * GiB, f"{cg}/system.slice/slurmstepd.scope/job_52/step_0/user/task_0") == 0
    assert sim.mem_get_info(0, task)[0] == 0  # free is the job's headroom; total is the GPU's (a parent's limit)
    record = Path(root) / "job_51" / hardcap.DRIVER_RECORD
    assert json.loads(record.read_text()) == {"cgroup": job_cg, "gpus": [0, 1]}
    assert not (Path(root) / "job_51" / "gpu0").exists()  # no shim files: the driver holds the job
    hardcap.clear("51", root, backend=sim)
    assert [sim.memory_limit(i, job_cg).hard for i in (0, 1)] == [None, None]
    assert not (Path(root) / "job_51").exists()


def test_auto_falls_back_to_the_shim_and_says_why_once(clock, roots: tuple[str, str], caplog) -> None:
    root, cg = roots
    sim = sim_node(clock, "absent")
    with caplog.at_level(logging.DEBUG, logger="gpushare.prolog"):
        assert hardcap.apply("51", os.geteuid(), [0], FRACTION, "auto", root, backend=sim, cgroup_root=cg) == "shim"
        assert hardcap.apply("52", os.geteuid(), [0], FRACTION, "auto", root, backend=sim, cgroup_root=cg) == "shim"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "r615" in warnings[0] and "using the shim" in warnings[0], warnings
    # the shim's context charge is the H100's (compute capability 9.0: 610 MiB context + 152 MiB of libraries)
    assert (Path(root) / "job_51" / "gpu0").read_text() == f"{2 * GiB} {762 << 20} {sim.gpu(0).uuid}\n"
    assert (Path(root) / "job_52" / "gpu0").exists()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpushare.prolog"):  # another reason is said again
        assert hardcap.apply("53", os.geteuid(), [0], FRACTION, "auto", root, backend=sim, cgroup_root=cg) == "shim"
    assert "no job cgroup" in caplog.text and "PrologFlags=Contain" in caplog.text


def test_driver_mode_where_unavailable_caps_nothing(clock, roots: tuple[str, str], tmp_path: Path) -> None:
    root, cg = roots
    assert hardcap.apply("51", 1000, [0], FRACTION, "driver", root, backend=sim_node(clock, "off"), cgroup_root=cg) == ""
    assert hardcap.apply("51", 1000, [0], FRACTION, "driver", root, backend=sim_node(clock, "dmem", "dmem"),
                         cgroup_root=str(tmp_path / "no-cgroup-v2")) == ""
    assert not (Path(root) / "job_51").exists()
    assert "cgroup v2" in (Path(root) / hardcap.UNAVAILABLE_NOTE).read_text()


def test_partial_failure_leaves_no_limit_set(clock, roots: tuple[str, str]) -> None:
    root, cg = roots
    job_cg = f"{cg}/system.slice/slurmstepd.scope/job_51"
    sim = sim_node(clock, "dmem", "off")
    why = hardcap.apply_driver("51", [0, 1], 2 * GiB, sim, root, cg)
    assert "does not account" in why and sim.memory_limit(0, job_cg).hard is None
    mig = SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb", "memory_limits": "dmem",
                                                            "mig_mode": True}]}, clock=clock)
    assert "MIG" in hardcap.apply_driver("51", [0], 2 * GiB, mig, root, cg)


@pytest.mark.parametrize("bad", ["other_job", "traversal", "symlink", "not_json"])
def test_epilog_ignores_a_bad_record_but_removes_the_folder(clock, roots: tuple[str, str], tmp_path: Path,
                                                           bad: str) -> None:
    root, cg = roots
    sim = sim_node(clock, "dmem")
    other = f"{cg}/system.slice/slurmstepd.scope/job_52"
    sim.set_memory_limit(0, other, GiB)
    d = Path(root) / "job_51"
    d.mkdir(parents=True)
    text = {"other_job": json.dumps({"cgroup": other, "gpus": [0]}),
            "traversal": json.dumps({"cgroup": f"{other}/../job_51/../../job_52/x/../../job_51", "gpus": [0]}),
            "not_json": "{", "symlink": ""}[bad]
    if bad == "symlink":
        (tmp_path / "elsewhere").write_text(json.dumps({"cgroup": other.replace("52", "51"), "gpus": [0]}))
        (d / hardcap.DRIVER_RECORD).symlink_to(tmp_path / "elsewhere")
    else:
        (d / hardcap.DRIVER_RECORD).write_text(text)
    hardcap.clear("51", root, backend=sim)
    assert sim.memory_limit(0, other).hard == GiB and not d.exists()


def test_epilog_removes_the_folder_of_a_job_the_prolog_capped(clock, tmp_path: Path, monkeypatch) -> None:
    """register (the Prolog, agent down) under hardcap=auto writes the shim's files for a shared job
    (no job cgroup on this host's test layout); close_job (the Epilog) removes them."""
    monkeypatch.setattr(hardcap, "HARDCAP_DIR", str(tmp_path / "hardcap"))
    cfg = parse_config({"agent": {"state_dir": str(tmp_path / "state"), "run_dir": str(tmp_path / "run"),
                                  "records_dir": str(tmp_path / "records"), "hardcap": "auto",
                                  "admin_comment": "no"}}).agent
    (tmp_path / "state").mkdir()
    sim = SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a100-40gb"}, {"model": "a100-40gb"}]},
                                   clock=clock)
    env = {"SLURM_JOB_ID": "61", "SLURM_JOB_UID": str(os.geteuid()), "SLURM_JOB_USER": "alice", "SLURM_JOB_GPUS": "1"}

    class Slurm:
        def job(self, job: str):  # the job's record as Slurm's JSON gives it: a shared job of 5 shards
            from gpushare.slurm.jobs import job_from_json

            return job_from_json({"tres_per_node": "gres:shard:5", "job_state": "COMPLETED",
                                  "admin_comment": 'gpushare:{"v":1,"decision":"shared","est_gib":4.0,"margin_gib":1.0}'})

    exports = register(env, cfg, client=Slurm(), backend=sim)
    assert exports is not None and exports["GPUSHARE_HARDCAP"] == "1"
    assert (tmp_path / "hardcap" / "job_61" / "gpu0").exists()
    close_job(env, cfg, client=Slurm(), backend=sim)
    assert not (tmp_path / "hardcap" / "job_61").exists()
