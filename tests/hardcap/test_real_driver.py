"""The hard cap shim over the real CUDA driver: skipped where no GPU answers cuInit (CI has none).

A 2 GiB share with a 300 MiB context charge: 256 MiB blocks stop at 1536 MiB with CUDA_ERROR_OUT_OF_MEMORY
and cuMemGetInfo reports the slice, whether the program reached the driver by dlsym or cuGetProcAddress_v2;
the same program without the shim gets all 16 GiB it asks for."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.hardcap

HERE = Path(__file__).parent


def _gpu() -> bool:
    try:
        return ctypes.CDLL("libcuda.so.1").cuInit(0) == 0
    except OSError:
        return False


@pytest.mark.skipif(not shutil.which("gcc") or os.geteuid() != 0 or not _gpu(), reason="needs gcc, root and a GPU")
@pytest.mark.parametrize("way", ["dlsym", "procaddr"])
def test_real_driver_is_capped_at_the_share(tmp_path: Path, way: str) -> None:
    subprocess.run(["gcc", "-O2", "-DHARDCAP_TESTING", "-fPIC", "-shared", "-o", str(tmp_path / "shim.so"),
                    str(HERE.parents[1] / "gres/hardcap/hardcap.c"), "-ldl", "-lpthread"], check=True)
    subprocess.run(["gcc", "-O2", "-o", str(tmp_path / "real"), str(HERE / "real_driver.c"), "-ldl"], check=True)
    (tmp_path / "lim/job_9").mkdir(parents=True)
    (tmp_path / "lim/job_9/gpu0").write_text(f"{2048 << 20} {300 << 20}\n")
    os.chmod(tmp_path / "lim/job_9/gpu0", 0o644)
    (tmp_path / "cg").write_text("0::/system.slice/slurmstepd.scope/job_9/step_0\n")
    env = dict(os.environ, GPUSHARE_HARDCAP_DIR=str(tmp_path / "lim"), GPUSHARE_HARDCAP_CGROUP=str(tmp_path / "cg"))
    plain = subprocess.run([str(tmp_path / "real"), way], env=env, capture_output=True, text=True, timeout=120).stdout
    assert f"{way} allocated 16384 MiB result 0" in plain
    capped = subprocess.run([str(tmp_path / "real"), way], env=dict(env, LD_PRELOAD=str(tmp_path / "shim.so")),
                            capture_output=True, text=True, timeout=120).stdout
    assert f"{way} allocated 1536 MiB result 2" in capped and "total 2048 MiB info 0" in capped


def _nvml_driver() -> str | None:
    """The driver's version where NVML answers, else None."""
    try:
        from gpushare.gres.nvml_backend import NvmlBackend

        backend = NvmlBackend()
        backend.gpu_count()
        version = backend.nvml.lib.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - no driver, no binding: the test is skipped
        return None


@pytest.mark.skipif(os.geteuid() != 0 or _nvml_driver() is None, reason="needs root and an NVIDIA driver")
def test_driver_backend_on_the_real_driver(tmp_path: Path) -> None:
    """Before r615 the driver has no per-cgroup limits: the device interface says FUNCTION_NOT_FOUND and the
    Prolog's reason names r615. From r615 on, a limit set on a fresh cgroup v2 reads back and clears."""
    from gpushare.gres import GpuError, NvmlCode
    from gpushare.gres.nvml_backend import NvmlBackend
    from gpushare.node import hardcap

    version = _nvml_driver()
    assert version is not None
    backend = NvmlBackend()
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").is_file()
    print(f"driver {version}, kernel {os.uname().release}, cgroup v2 {v2}")
    if int(version.split(".")[0]) < 615:
        with pytest.raises(GpuError) as err:
            backend.set_memory_limit(0, "/sys/fs/cgroup", 1 << 30)
        assert err.value.code is NvmlCode.FUNCTION_NOT_FOUND
        why = hardcap._driver_reason(err.value)
        print("driver backend:", why)
        assert "r615" in why
        return
    if not v2:
        pytest.skip("r615+ driver but no cgroup v2 here to set a limit on")
    cg = Path("/sys/fs/cgroup") / f"gpushare-probe-{os.getpid()}"
    cg.mkdir()
    try:
        try:
            backend.set_memory_limit(0, str(cg), 1 << 30)
        except GpuError as exc:
            print("driver backend:", hardcap._driver_reason(exc))
            assert exc.code in (NvmlCode.NOT_SUPPORTED, NvmlCode.NOT_FOUND)
            return
        got = backend.memory_limit(0, str(cg))
        print("driver backend: set", got)
        assert got.hard == 1 << 30
        backend.clear_memory_limit(0, str(cg))
        assert backend.memory_limit(0, str(cg)).hard is None
    finally:
        cg.rmdir()


@pytest.mark.skipif(not shutil.which("gcc") or os.geteuid() != 0 or _nvml_driver() is None,
                    reason="needs gcc, root and an NVIDIA driver")
def test_real_nvml_memory_info_is_clamped(tmp_path: Path) -> None:
    """pynvml in a job's process (the shim preloaded, a job cgroup, the GPU's UUID in the limits file) reads
    a 2 GiB slice; nvidia-smi's view under the same preload is printed (it may bind NVML its own way)."""
    import pynvml

    subprocess.run(["gcc", "-O2", "-DHARDCAP_TESTING", "-fPIC", "-shared", "-o", str(tmp_path / "shim.so"),
                    str(HERE.parents[1] / "gres/hardcap/hardcap.c"), "-ldl", "-lpthread"], check=True)
    pynvml.nvmlInit()
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    (tmp_path / "lim/job_9").mkdir(parents=True)
    (tmp_path / "lim/job_9/gpu0").write_text(f"{2048 << 20} {300 << 20} {uuid}\n")
    os.chmod(tmp_path / "lim/job_9/gpu0", 0o644)
    (tmp_path / "cg").write_text("0::/system.slice/slurmstepd.scope/job_9/step_0\n")
    env = dict(os.environ, GPUSHARE_HARDCAP_DIR=str(tmp_path / "lim"), GPUSHARE_HARDCAP_CGROUP=str(tmp_path / "cg"),
               LD_PRELOAD=str(tmp_path / "shim.so"))
    code = ("import pynvml; pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
            "m = pynvml.nvmlDeviceGetMemoryInfo(h); m2 = pynvml.nvmlDeviceGetMemoryInfo(h, pynvml.nvmlMemory_v2)\n"
            "print(m.total >> 20, m.used >> 20, m.free >> 20, m2.total >> 20, m2.free >> 20)\n")
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    print("pynvml under the shim (MiB total used free, v2 total free):", got.stdout.strip(), got.stderr[-300:])
    total, used, free, total2, free2 = (int(w) for w in got.stdout.split())
    assert total == total2 == 2048 and used == 0 and free <= 2048 and free2 <= 2048
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "-i", "0", "--query-gpu=memory.total,memory.used", "--format=csv,noheader"]
        print("nvidia-smi under the shim:", subprocess.run(query, env=env, capture_output=True, text=True).stdout.strip(),
              "without:", subprocess.run(query, capture_output=True, text=True).stdout.strip())
