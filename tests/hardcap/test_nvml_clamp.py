"""NVML's memory info clamped by the shim (gres/hardcap/hardcap.c) for the job's GPUs, over a fake NVML
library (fake_nvml.c) that reports the fake driver's shared device memory: a job's process asking NVML
sees its slice (total = its share, used = the job's charge, free = what is left of it), through dlsym as
pynvml and ctypes reach it; a GPU whose UUID is not the limits file's, or a process in no job cgroup,
sees the whole device; asking NVML takes no slot and no context charge."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.hardcap

HERE = Path(__file__).parent
UUID = "GPU-1b6e5f3a-0c1d-4e2f-9a8b-7c6d5e4f3a2b"
SHARE, CTX, TOTAL = 100000, 1000, 1000000
QUERY = (
    "import ctypes, sys\n"
    "cu = ctypes.CDLL('libcuda.so.1'); nv = ctypes.CDLL('libnvidia-ml.so.1')\n"
    "for _ in range(int(sys.argv[1])):\n"
    "    assert cu.cuMemAlloc_v2(ctypes.byref(ctypes.c_ulonglong()), ctypes.c_size_t(10000)) == 0\n"
    "class M1(ctypes.Structure): _fields_ = [(n, ctypes.c_ulonglong) for n in ('total', 'free', 'used')]\n"
    "class M2(ctypes.Structure): _fields_ = [('version', ctypes.c_uint)] + [(n, ctypes.c_ulonglong) for n in "
    "('total', 'reserved', 'free', 'used')]\n"
    "h = ctypes.c_void_p(); assert nv.nvmlInit_v2() == 0 and nv.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)) == 0\n"
    "m1, m2 = M1(), M2(version=(2 << 24) | ctypes.sizeof(M2))\n"
    "r1, r2 = nv.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m1)), nv.nvmlDeviceGetMemoryInfo_v2(h, ctypes.byref(m2))\n"
    "print('v1', r1, m1.total, m1.free, m1.used, 'v2', r2, m2.total, m2.reserved, m2.free, m2.used)\n"
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not shutil.which("gcc"):
        pytest.skip("gcc absent (make setup installs it)")
    d = tmp_path_factory.mktemp("nvml_bin")
    for cmd in (["-fPIC", "-shared", "-o", str(d / "libcuda.so.1"), str(HERE / "fake_cuda.c")],
                ["-fPIC", "-shared", "-o", str(d / "libnvidia-ml.so.1"), str(HERE / "fake_nvml.c")],
                ["-DHARDCAP_TESTING", "-fPIC", "-shared", "-o", str(d / "libshim.so"),
                 str(HERE.parents[1] / "gres/hardcap/hardcap.c"), "-ldl", "-lpthread"]):
        subprocess.run(["gcc", "-O2", "-Wall", *cmd], check=True, capture_output=True)
    return d


@pytest.fixture
def env(built: Path, tmp_path: Path) -> dict[str, str]:
    """Job 4343 with a 100000-byte share of a 1 MB fake device, its limits file naming the GPU's UUID."""
    from gpushare.node.hardcap import write_limits

    write_limits("4343", os.geteuid(), 1, SHARE, str(tmp_path / "limits"), context_bytes=CTX, uuids=[UUID])
    (tmp_path / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_4343/step_0/user/task_0\n")
    return dict(os.environ, FAKE_CUDA_MEM=str(tmp_path / "devmem"), FAKE_CUDA_TOTAL=str(TOTAL), FAKE_NVML_UUID=UUID,
                LD_LIBRARY_PATH=str(built), GPUSHARE_HARDCAP_DIR=str(tmp_path / "limits"),
                GPUSHARE_HARDCAP_CGROUP=str(tmp_path / "cgroup"), LD_PRELOAD=str(built / "libshim.so"))


def query(env: dict[str, str], allocs: int = 3) -> list[int]:
    out = subprocess.run([sys.executable, "-c", QUERY, str(allocs)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return [int(w) for w in out.stdout.split() if w.lstrip("-").isdigit()]


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="limits files must be root-owned: run as root")


@needs_root
def test_nvml_memory_info_shows_the_jobs_slice(env: dict[str, str]) -> None:
    r1, total1, free1, used1, r2, total2, reserved, free2, used2 = query(env)
    charged = CTX + 3 * 10000  # this process's context charge and its three allocations
    assert (r1, total1, free1, used1) == (0, SHARE, SHARE - charged, charged)
    # the driver's reservation (1 MiB in the fake) is outside the job's share: none in the slice
    assert (r2, total2, reserved, free2, used2) == (0, SHARE, 0, SHARE - charged, charged)


@needs_root
def test_another_gpu_or_no_job_sees_the_whole_device(env: dict[str, str], tmp_path: Path) -> None:
    r1, total1, free1, used1, *_ = query(dict(env, FAKE_NVML_UUID="GPU-ffffffff-0000-0000-0000-000000000000"))
    assert (r1, total1, used1, free1) == (0, TOTAL, 30000, TOTAL - 30000)  # capped allocations, NVML unclamped
    (tmp_path / "cgroup").write_text("0::/user.slice/user-1000.slice/session-3.scope\n")
    r1, total1, free1, used1, *_ = query(env)
    assert (r1, total1, used1, free1) == (0, TOTAL, 60000, TOTAL - 60000)  # the fake keeps what exited processes took


@needs_root
def test_asking_nvml_takes_no_slot_and_no_context_charge(env: dict[str, str], tmp_path: Path) -> None:
    query(env, allocs=0)  # NVML only: registers nothing (no CUDA allocation, no context)
    state = tmp_path / "limits" / "job_4343" / "gpu0.state"
    assert state.stat().st_size == 0  # the Prolog's empty usage file, never mapped
