"""The hard cap shim (gres/hardcap/hardcap.c) on real processes over a fake driver (fake_cuda.c): its device
memory is a shared file, so a process without the shim runs out only at the fake device's size, and every
process of a test sees the same device. The shim is built in its testing variant, which reads the limits
directory and the cgroup file from the environment instead of /run/gpushare/hardcap and /proc/self/cgroup."""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.hardcap

HERE = Path(__file__).parent
SHIM_SRC = HERE.parents[1] / "gres" / "hardcap" / "hardcap.c"
JOB = "4242"
CTX = 1000  # the per-process context charge the tests' limits files declare


def _cc(*args: str) -> None:
    subprocess.run(["gcc", "-O2", "-Wall", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not shutil.which("gcc"):
        pytest.skip("gcc absent (make setup installs it)")
    d = tmp_path_factory.mktemp("hardcap_bin")
    (d / "driver").mkdir()
    _cc("-fPIC", "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(d / "driver" / "libcuda.so.1"), str(HERE / "fake_cuda.c"))
    _cc("-DHARDCAP_TESTING", "-fPIC", "-shared", "-o", str(d / "libshim.so"), str(SHIM_SRC), "-ldl", "-lpthread")
    _cc("-o", str(d / "alloc_dl"), str(HERE / "alloc.c"), "-ldl")
    _cc("-DLINKED", "-o", str(d / "alloc_ln"), str(HERE / "alloc.c"), str(d / "driver" / "libcuda.so.1"), "-ldl",
        f"-Wl,-rpath,{d / 'driver'}")
    for prog, extra in (("plain_driver", ()), ("race", (f"-I{SHIM_SRC.parent}", "-lpthread"))):
        _cc("-o", str(d / prog), str(HERE / f"{prog}.c"), str(d / "driver" / "libcuda.so.1"), *extra,
            f"-Wl,-rpath,{d / 'driver'}")
    return d


@pytest.fixture
def env(built: Path, tmp_path: Path) -> dict[str, str]:
    """A job 4242 with a 100000-byte share of a 1 MB fake device."""
    limits = tmp_path / "limits"
    (limits / f"job_{JOB}").mkdir(parents=True)
    write_limits(limits / f"job_{JOB}" / "gpu0", f"100000 {CTX}\n")
    cg = tmp_path / "cgroup"
    cg.write_text(f"0::/system.slice/slurmstepd.scope/job_{JOB}/step_0/user/task_0\n")
    e = dict(os.environ)
    e.update(FAKE_CUDA_MEM=str(tmp_path / "devmem"), FAKE_CUDA_TOTAL="1000000", LD_LIBRARY_PATH=str(built / "driver"),
             GPUSHARE_HARDCAP_DIR=str(limits), GPUSHARE_HARDCAP_CGROUP=str(cg), LD_PRELOAD=str(built / "libshim.so"))
    return e


def write_limits(path: Path, text: str) -> None:
    path.write_text(text)
    os.chmod(path, 0o644)


def run_alloc(built: Path, env: dict[str, str], way: str, chunk: int, count: int, hold: int | None = None,
              ) -> subprocess.CompletedProcess[str]:
    exe = built / ("alloc_ln" if way == "linked" else "alloc_dl")
    args = [str(exe), way, str(chunk), str(count)] + ([str(hold)] if hold is not None else [])
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=30)


def parse(out: str) -> dict[str, int]:
    words = out.split()
    return {words[i]: int(words[i + 1]) for i in range(0, len(words) - 1, 2)}


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="limits files must be root-owned: run as root")


@needs_root
@pytest.mark.parametrize("way", ["linked", "dlopen", "procaddr", "async", "async_ptsz"])
def test_every_way_to_the_driver_is_capped_at_the_share(built: Path, env: dict[str, str], way: str) -> None:
    got = parse(run_alloc(built, env, way, 10000, 100).stdout)
    assert got["allocated"] == 90000 and got["result"] == 2  # 100000 less the context charge: OUT_OF_MEMORY
    assert got["total"] == 100000 and got["free"] == 100000 - CTX - 90000 and got["info"] == 0


@needs_root
def test_without_the_shim_the_fake_device_runs_out_at_its_size(built: Path, env: dict[str, str]) -> None:
    env = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    got = parse(run_alloc(built, env, "dlopen", 100000, 100).stdout)
    assert got["allocated"] == 1000000 and got["result"] == 2 and got["total"] == 1000000


@needs_root
def test_process_outside_a_job_cgroup_is_not_capped(built: Path, env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "cgroup").write_text("0::/user.slice/user-1000.slice/session-3.scope\n")
    got = parse(run_alloc(built, env, "linked", 100000, 5).stdout)
    assert got["allocated"] == 500000


@needs_root
def test_python_ctypes_and_fork_share_one_budget(built: Path, env: dict[str, str]) -> None:
    script = (
        "import ctypes, os, sys\n"
        "cu = ctypes.CDLL('libcuda.so.1')\n"
        "def grab(n):\n"
        "    got = 0\n"
        "    while cu.cuMemAlloc_v2(ctypes.byref(ctypes.c_ulonglong()), ctypes.c_size_t(1000)) == 0:\n"
        "        got += 1000\n"
        "        if got >= n: break\n"
        "    return got\n"
        "a = grab(30000)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    print('child', grab(10**9), flush=True); os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print('parent', a, flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30)
    got = parse(out.stdout)
    assert got["parent"] == 30000
    assert got["child"] == 100000 - 2 * CTX - 30000  # the child is a process of its own: its own context charge


@needs_root
def test_racing_processes_reach_the_limit_exactly(built: Path, env: dict[str, str]) -> None:
    n = 8
    procs = [subprocess.Popen([str(built / "alloc_dl"), "dlopen", "100", "100000", "2"], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(n)]
    # each holds its memory 2 s after its last try, so no charge is given back (swept) while others race
    total = sum(parse(p.communicate(timeout=30)[0])["allocated"] for p in procs)
    # Every byte of the share is taken, none twice: the processes whose context charge came after the share was
    # full are charged none (their allocations fail as the driver's would), so k of n contexts are in the total.
    state = Path(env["GPUSHARE_HARDCAP_DIR"]) / f"job_{JOB}" / "gpu0.state"
    used = int.from_bytes(state.read_bytes()[8:16], "little", signed=True)  # not yet swept: all have exited
    assert used == 100000
    k, rest = divmod(100000 - total, CTX)
    assert rest == 0 and 1 <= k <= n


@needs_root
def test_process_killed_mid_allocation_leaks_no_charge(built: Path, env: dict[str, str]) -> None:
    slow = dict(env, FAKE_CUDA_ALLOC_SLEEP_MS="20000")
    p = subprocess.Popen([str(built / "alloc_dl"), "dlopen", "50000", "1"], env=slow, stdout=subprocess.PIPE)
    time.sleep(0.5)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=10)
    got = parse(run_alloc(built, env, "dlopen", 1000, 1000).stdout)  # registering sweeps the dead process
    assert got["allocated"] == 100000 - CTX


@needs_root
def test_process_killed_while_holding_the_lock_stalls_nobody(built: Path, env: dict[str, str]) -> None:
    run_alloc(built, env, "dlopen", 1000, 1)  # creates the usage file
    state = Path(env["GPUSHARE_HARDCAP_DIR"]) / f"job_{JOB}" / "gpu0.state"
    holder = subprocess.Popen([sys.executable, "-c",
                               "import fcntl, sys, time\n"
                               f"f = open({str(state)!r}, 'r+'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True)\n"
                               "time.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    t = time.monotonic()
    got = parse(run_alloc(built, env, "dlopen", 1000, 1000).stdout)
    assert got["allocated"] == 100000 - CTX and time.monotonic() - t < 5
    with open(state, "r+") as f:  # and the lock is free again
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


@needs_root
@pytest.mark.parametrize("bad", ["symlink", "not_root", "group_writable", "malformed"])
def test_bad_limits_file_leaves_the_shim_passive_with_one_line(built: Path, env: dict[str, str], tmp_path: Path,
                                                               bad: str) -> None:
    f = Path(env["GPUSHARE_HARDCAP_DIR"]) / f"job_{JOB}" / "gpu0"
    if bad == "symlink":
        real = tmp_path / "elsewhere"
        write_limits(real, "100000 0\n")
        f.unlink()
        f.symlink_to(real)
    elif bad == "not_root":
        os.chown(f, 65534, 65534)
    elif bad == "group_writable":
        os.chmod(f, 0o664)
    else:
        write_limits(f, "lots\n")
    out = run_alloc(built, env, "linked", 100000, 5)
    assert parse(out.stdout)["allocated"] == 500000
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("gpushare-hardcap:")]
    assert len(lines) == 1 and "not capping" in lines[0], out.stderr


def test_shim_never_loads_the_driver_into_a_process_that_does_not(built: Path, env: dict[str, str]) -> None:
    script = ("import ctypes\n"
              "try:\n    ctypes.CDLL(None).cuMemAlloc_v2\nexcept AttributeError:\n    pass\n"
              "print('libcuda' in open('/proc/self/maps').read())\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "False", out.stderr


@needs_root
def test_plain_driver_api_program_is_capped_at_the_share(built: Path, env: dict[str, str]) -> None:
    """A program written for the driver API and not for the shim (tests/hardcap/plain_driver.c: cuInit,
    cuDeviceGetCount, cuDeviceGet, cuDeviceGetName, cuDeviceTotalMem, cuCtxCreate, blocks until refused,
    cuMemGetInfo, frees, cuCtxDestroy) gets OUT_OF_MEMORY at its share, sees the slice in cuMemGetInfo and
    its budget back after freeing; the device's own total (cuDeviceTotalMem) is left alone."""
    out = subprocess.run([str(built / "plain_driver"), "10000", "100"], env=env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    got = parse(out.stdout)
    assert got["devices"] == 1 and got["total_mem"] == 1000000
    assert got["allocated"] == 90000 and got["result"] == 2  # 100000 less the context charge
    assert got["total"] == 100000 and got["free"] == 100000 - CTX - 90000
    assert got["total_after"] == 100000 and got["free_after"] == 100000 - CTX
    plain = subprocess.run([str(built / "plain_driver"), "10000", "100"], capture_output=True, text=True, timeout=30,
                           env={k: v for k, v in env.items() if k != "LD_PRELOAD"})
    assert parse(plain.stdout)["allocated"] == 1000000  # the fake device's size: the shim made the difference
