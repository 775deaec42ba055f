"""Which job a GPU process belongs to: the kernel's cgroup record, not the process's own environment."""

from __future__ import annotations

import os
from pathlib import Path

from gpushare.agent.sampler import process_job


def _proc(tmp_path: Path, pid: int, cgroup: str, environ: bytes) -> str:
    (tmp_path / str(pid)).mkdir()
    (tmp_path / str(pid) / "cgroup").write_text(cgroup)
    (tmp_path / str(pid) / "environ").write_bytes(environ)
    return str(tmp_path)


def test_a_spoofed_slurm_job_id_does_not_move_a_process_to_another_job(tmp_path: Path) -> None:
    """A process may export SLURM_JOB_ID=<someone else's job> (to shift its memory or energy onto that
    job, or to inflate a job's measured peak); its cgroup says where Slurm put it."""
    proc = _proc(tmp_path, 10, "0::/system.slice/slurmstepd.scope/job_123/step_0/user/task_0\n",
                 b"PATH=/bin\0SLURM_JOB_ID=999\0")
    assert process_job(10, proc) == "123"
    v1 = _proc(tmp_path, 11, "12:memory:/slurm/uid_1000/job_77/step_batch\n4:cpuset:/slurm/uid_1000/job_77\n",
               b"SLURM_JOB_ID=999\0")
    assert process_job(11, v1) == "77"


def test_a_slurm_daemon_is_no_job_and_no_cgroups_falls_back_to_the_environment(tmp_path: Path) -> None:
    proc = _proc(tmp_path, 12, "0::/system.slice/slurmstepd.scope/system\n", b"SLURM_JOB_ID=5\0")
    assert process_job(12, proc) is None
    plain = _proc(tmp_path, 13, "0::/user.slice/user-1000.slice/session-1.scope\n", b"SLURM_JOB_ID=5\0")
    no_cgroups = tmp_path / "cgroup-none"
    no_cgroups.mkdir()
    assert process_job(13, plain, str(no_cgroups)) == "5"  # proctrack/linuxproc: the environment is all
    with_cgroups = tmp_path / "cgroup-slurm"
    (with_cgroups / "system.slice" / "slurmstepd.scope").mkdir(parents=True)
    assert process_job(13, plain, str(with_cgroups)) is None  # an ssh session claiming a job: no job
    assert process_job(14, str(tmp_path)) is None  # gone


def test_a_process_uid_is_its_real_uid_even_when_it_makes_itself_look_like_roots(tmp_path: Path) -> None:
    """``prctl(PR_SET_DUMPABLE, 0)`` makes proc(5) show a process's files as root's; root's processes are
    never stopped as unattributed, so such an owner would be a way out of the backstop. The real uid in
    ``status`` is what counts."""
    from gpushare.agent.adopt import process_uid

    (tmp_path / "20").mkdir()
    (tmp_path / "20" / "status").write_text("Name:\tpython\nUid:\t1000\t0\t0\t0\nGid:\t1000\t1000\t1000\t1000\n")
    assert process_uid(20, str(tmp_path)) == 1000
    assert process_uid(21, str(tmp_path)) is None
    assert process_uid(os.getpid()) == os.getuid()


def test_a_multiple_slurmd_build_names_its_v1_hierarchy_after_the_node(tmp_path: Path) -> None:
    """Debian's Slurm is built for several slurmd per host: its cgroup v1 jobs live under ``slurm_<node>``.
    That node's hierarchy means an ssh session's claimed SLURM_JOB_ID is ignored there; another node's
    hierarchy on the same host (a second slurmd) says nothing about this one."""
    plain = _proc(tmp_path, 15, "4:freezer:/user.slice\n", b"SLURM_JOB_ID=5\0")
    cgroups = tmp_path / "cgroup-v1"
    (cgroups / "freezer" / "slurm_gpu1").mkdir(parents=True)
    assert process_job(15, plain, str(cgroups), node="gpu1") is None
    assert process_job(15, plain, str(cgroups), node="gpu2") == "5"
    inside = _proc(tmp_path, 16, "4:freezer:/slurm_gpu1/uid_0/job_42/step_0\n", b"SLURM_JOB_ID=5\0")
    assert process_job(16, inside, str(cgroups), node="gpu1") == "42"
