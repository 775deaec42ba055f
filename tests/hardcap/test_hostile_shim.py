"""The hard cap shim against a user who tries to get past it, and against a node whose runtime directory
was made by something else first (docs/security.md lists each bound with its test).

- Racing threads, one of them asking for sizes of 2^63 and more over every allocation entry point the shim
  wraps, never get more than the share between them, and every charge is given back exactly.
- A copy of the driver with its SONAME changed, opened by its path, hands out no allocation entry point in a
  capped job.
- A runtime directory made first by the AdminComment lock (or left 0700 by an older release) still lets the
  job's user read the limits, so jobs run by an ordinary user are capped; ``gpushare doctor`` says when they
  would not be.

Over the fake driver (fake_cuda.c), as tests/hardcap/test_shim.py; root is needed to write root-owned
limits files, and the folder tests run the job's program as the ordinary test user."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpushare.node.doctor import OK, PROBLEM, hardcap_check
from gpushare.config import Config
from gpushare.node.hardcap import write_limits as prolog_write_limits
from gpushare.slurm.admin_comment import _host_lock
from tests.hardcap import test_shim as shim
from tests.hardcap.test_shim import CTX, JOB, needs_root, parse

built, env = shim.built, shim.env  # the shim's own tests' fixtures: the fake driver, a capped job

pytestmark = [pytest.mark.hardcap, pytest.mark.hostile, needs_root]
SHARE = 100000  # the env fixture's share of its 1 MB fake device


def used(env: dict[str, str]) -> int:
    state = Path(env["GPUSHARE_HARDCAP_DIR"]) / f"job_{JOB}" / "gpu0.state"
    return int.from_bytes(state.read_bytes()[8:16], "little", signed=True)


def test_huge_sizes_racing_allocations_never_let_the_job_past_its_share(built: Path, env: dict[str, str]) -> None:
    # the fake takes 1 ms to refuse, as a driver is not instant either: without the fix the hostile thread's
    # charge of 2^63 + 4096 (a negative number, taken as signed) stood in the counter for that long on every call
    racing = dict(env, FAKE_CUDA_REFUSE_SLEEP_US="1000")
    out = subprocess.run([str(built / "race"), "4", "4096", "2000"], env=racing, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    got = parse(out.stdout)
    assert got["granted"] == (SHARE - CTX) // 4096 * 4096, got  # every whole block of the share, none past it
    assert got["hostile_granted"] == 0 and got["hostile_calls"] > 0 and got["freed_failures"] == 0, got
    assert used(env) == CTX  # every charge refunded exactly: only the process's context charge is left


def test_huge_size_is_refused_without_reaching_the_driver(built: Path, env: dict[str, str]) -> None:
    """A size past the whole share is refused by the shim itself: the fake driver never sees it (with a
    20 s refusal, a call that reached it would time the test out)."""
    script = ("import ctypes\n"
              "cu = ctypes.CDLL('libcuda.so.1'); p = ctypes.c_ulonglong(); pitch = ctypes.c_size_t()\n"
              "print('alloc', cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(2**63 + 4096)),\n"
              "      'pitch', cu.cuMemAllocPitch_v2(ctypes.byref(p), ctypes.byref(pitch), ctypes.c_size_t(2**40),\n"
              "                                     ctypes.c_size_t(2**25), 4),\n"
              "      'small', cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(4096)))\n")
    out = subprocess.run([sys.executable, "-c", script], env=dict(env, FAKE_CUDA_REFUSE_SLEEP_US="20000000"),
                         capture_output=True, text=True, timeout=15)
    assert parse(out.stdout) == {"alloc": 2, "pitch": 2, "small": 0}, out.stdout + out.stderr
    assert used(env) == CTX + 4096


@pytest.fixture
def copy(built: Path, tmp_path: Path) -> Path:
    """The fake driver with its SONAME patched (libcuda.so.1 → libcudx.so.1), so that it loads beside
    libcuda.so.1, as a user would copy the real one."""
    data = (built / "driver" / "libcuda.so.1").read_bytes()
    assert data.count(b"libcuda.so.1\0") == 1
    path = tmp_path / "libcudx.so.1"
    path.write_bytes(data.replace(b"libcuda.so.1\0", b"libcudx.so.1\0"))
    return path


def test_a_renamed_copy_of_the_driver_hands_out_no_allocation_in_a_capped_job(built: Path, env: dict[str, str],
                                                                              copy: Path) -> None:
    out = subprocess.run([str(built / "alloc_dl"), str(copy), "10000", "100"], env=env, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 66 and "refused by gpushare-hardcap" in out.stderr, out.stdout + out.stderr
    assert "second copy of the CUDA driver" in out.stderr
    script = ("import ctypes\n"
              f"cu = ctypes.CDLL({str(copy)!r})\n"
              "for name in ('cuMemAlloc_v2', 'cuGetProcAddress_v2', 'cuMemCreate', 'cuMemAllocAsync'):\n"
              "    try:\n        getattr(cu, name); print(name, 'found')\n"
              "    except AttributeError:\n        print(name, 'refused')\n"
              "print('cuInit', 'found' if cu.cuInit(0) == 0 else 'failed')\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert dict(line.split() for line in out.stdout.splitlines()) == {"cuMemAlloc_v2": "refused", "cuGetProcAddress_v2": "refused",
                                 "cuMemCreate": "refused", "cuMemAllocAsync": "refused", "cuInit": "found"}, out
    # outside a capped job the copy is any other library
    outside = dict(env, GPUSHARE_HARDCAP_CGROUP=str(Path(env["GPUSHARE_HARDCAP_CGROUP"]).with_name("nojob")))
    Path(outside["GPUSHARE_HARDCAP_CGROUP"]).write_text("0::/user.slice/user-1000.slice/session-3.scope\n")
    got = parse(subprocess.run([str(built / "alloc_dl"), str(copy), "10000", "100"], env=outside,
                               capture_output=True, text=True, timeout=30).stdout)
    assert got["allocated"] == 1000000


@pytest.fixture
def node(built: Path) -> Iterator[tuple[Path, dict[str, str], object]]:
    """A node's runtime directory (``run``, standing for /run/gpushare) in a folder every user can reach, the
    test programs copied there, and the environment of a job of the ordinary test user."""
    from devcluster.local_cluster import ensure_login_user

    user = ensure_login_user()
    base = Path(tempfile.mkdtemp(prefix="gpushare-hardcap-node-", dir="/tmp"))
    os.chmod(base, 0o755)
    shutil.copytree(built, base / "bin")
    for folder in (base / "bin", base / "bin" / "driver"):
        os.chmod(folder, 0o755)  # copied with the mode of pytest's root-only folder
    devmem = base / "devmem"  # the fake device, shared with the job's user
    devmem.touch()
    os.chmod(devmem, 0o666)
    cgroup = base / "cgroup"
    cgroup.write_text(f"0::/system.slice/slurmstepd.scope/job_{JOB}/step_0/user/task_0\n")
    os.chmod(cgroup, 0o644)
    job_env = dict(os.environ, FAKE_CUDA_MEM=str(devmem), FAKE_CUDA_TOTAL="1000000",
                   LD_LIBRARY_PATH=str(base / "bin" / "driver"), GPUSHARE_HARDCAP_DIR=str(base / "run" / "hardcap"),
                   GPUSHARE_HARDCAP_CGROUP=str(cgroup), LD_PRELOAD=str(base / "bin" / "libshim.so"))
    yield base, job_env, user
    shutil.rmtree(base, ignore_errors=True)


def run_as_user(base: Path, job_env: dict[str, str], user: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(base / "bin" / "alloc_dl"), "dlopen", "10000", "100"], env=job_env, cwd=base,
                          user=user.pw_uid, group=user.pw_gid, capture_output=True, text=True,  # type: ignore[attr-defined]
                          timeout=30)


@pytest.mark.parametrize("first", ["admin_comment_lock", "older_release_0700"])
def test_jobs_of_an_ordinary_user_are_capped_whoever_made_the_runtime_directory(node, first: str) -> None:
    base, job_env, user = node
    run = base / "run"
    if first == "admin_comment_lock":
        with _host_lock(str(run)):  # an agent, Epilog or recovery writing an AdminComment before any Prolog
            pass
    else:
        run.mkdir()
        os.chmod(run, 0o700)
    prolog_write_limits(JOB, user.pw_uid, 1, SHARE, root=str(run / "hardcap"), context_bytes=CTX)
    out = run_as_user(base, job_env, user)
    assert "gpushare-hardcap" not in out.stderr, out.stderr  # never "cannot open limits file (Permission denied)"
    got = parse(out.stdout)
    assert got["allocated"] == 90000 and got["result"] == 2, out.stdout  # the share less the context charge
    assert os.stat(run).st_mode & 0o777 == 0o755
    with _host_lock(str(run)):  # and the lock still takes its lock file there (the folder is still only root's)
        assert (run / "admin-comment.lock").exists()


def test_doctor_reports_a_shim_that_would_not_cap(node, tmp_path: Path) -> None:
    base, job_env, user = node
    run = base / "run"
    run.mkdir()
    os.chmod(run, 0o700)
    cfg = Config()
    cfg.agent.hardcap = "shim"
    cfg.agent.hardcap_library = str(base / "bin" / "libshim.so")
    check = hardcap_check(cfg, str(run / "hardcap"))
    assert check is not None and check.status == PROBLEM and str(run) in check.detail, check
    assert "gpushare-hardcap: cannot open limits file" in run_as_user_after_limits(base, job_env, user, run)
    os.chmod(run, 0o755)
    check = hardcap_check(cfg, str(run / "hardcap"))
    assert check is not None and check.status == OK, check
    cfg.agent.hardcap = "off"
    assert hardcap_check(cfg, str(run / "hardcap")) is None
    cfg.agent.hardcap, cfg.agent.hardcap_library = "auto", str(tmp_path / "missing.so")
    cfg.agent.run_dir = str(tmp_path / "controller")  # no agent here: not a GPU node, nothing to say
    assert hardcap_check(cfg, str(run / "hardcap")) is None
    (tmp_path / "node" / "agent").mkdir(parents=True)  # a GPU node (the agent's socket folder) without the shim
    cfg.agent.run_dir = str(tmp_path / "node")
    check = hardcap_check(cfg, str(run / "hardcap"))
    assert check is not None and check.status == PROBLEM and "missing.so" in check.detail


def run_as_user_after_limits(base: Path, job_env: dict[str, str], user: object, run: Path) -> str:
    """The limits written as an older Prolog wrote them (into an existing 0700 runtime directory, nothing
    repaired): what the shim says to the job's user, the doctor's finding seen from the job."""
    hard = run / "hardcap" / f"job_{JOB}"
    hard.mkdir(parents=True)
    (hard / "gpu0").write_text(f"{SHARE} {CTX}\n")
    os.chmod(hard / "gpu0", 0o644)
    return run_as_user(base, job_env, user).stderr
