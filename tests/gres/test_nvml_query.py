"""NVML error semantics through the one choke point, on a fake binding module (no driver needed)."""

from __future__ import annotations

import logging
import subprocess
import sys
import types

import pytest

from gpushare.gres import NA, GpuError, NvmlCode
from gpushare.gres.nvml_backend import NvmlBackend, match_model, read_mig_minors
from gpushare.gres.nvml_query import RAISE, Nvml


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


def fake_module(**funcs) -> types.ModuleType:
    mod = types.ModuleType("fake_pynvml")
    mod.NVMLError = FakeNVMLError
    mod.calls = []
    mod.nvmlInit = lambda: mod.calls.append("init")
    mod.nvmlShutdown = lambda: mod.calls.append("shutdown")
    for name, fn in funcs.items():
        setattr(mod, name, fn)
    return mod


def raiser(code: int):
    def fn(*_):
        raise FakeNVMLError(code)
    return fn


def test_import_and_construct_without_driver():
    code = "import gpushare.gres.nvml_backend as m; b = m.NvmlBackend(); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "ok", out.stderr


def test_lazy_init_once_and_shutdown():
    mod = fake_module(nvmlDeviceGetCount_v2=lambda: 2)
    nv = Nvml(mod)
    assert mod.calls == []  # nothing touches the driver until the first query
    assert nv.query("nvmlDeviceGetCount_v2") == 2
    assert nv.query("nvmlDeviceGetCount_v2") == 2
    assert mod.calls == ["init"]
    nv.shutdown()
    assert mod.calls == ["init", "shutdown"]


def test_init_failure_is_a_clear_gpu_error():
    mod = fake_module()
    mod.nvmlInit = raiser(9)
    with pytest.raises(GpuError) as err:
        Nvml(mod).query("nvmlDeviceGetCount")
    assert err.value.code is NvmlCode.DRIVER_NOT_LOADED
    assert str(err.value).startswith("NVML not available")


def test_not_supported_reads_as_na_and_can_be_told_to_raise():
    nv = Nvml(fake_module(nvmlDeviceGetPowerUsage=raiser(3)))
    assert nv.query("nvmlDeviceGetPowerUsage", "h") is NA
    assert nv.query("nvmlDeviceGetPowerUsage", "h", default=None) is None
    with pytest.raises(GpuError) as err:
        nv.query("nvmlDeviceGetPowerUsage", "h", default=RAISE)
    assert err.value.not_supported


@pytest.mark.parametrize("code", [NvmlCode.GPU_IS_LOST, NvmlCode.NO_PERMISSION, NvmlCode.IN_USE,
                                  NvmlCode.INSUFFICIENT_RESOURCES, NvmlCode.INVALID_ARGUMENT, NvmlCode.NOT_FOUND])
def test_real_faults_raise_with_nvml_code(code):
    nv = Nvml(fake_module(nvmlDeviceGetMemoryInfo=raiser(int(code))))
    with pytest.raises(GpuError) as err:
        nv.query("nvmlDeviceGetMemoryInfo", "h")
    assert err.value.code is code
    assert f"NVML_ERROR_{code.name} ({int(code)})" in str(err.value)
    assert "nvmlDeviceGetMemoryInfo" in str(err.value)


def test_versioned_fallback_v3_to_v2_to_plain():
    mod = fake_module(nvmlDeviceGetComputeRunningProcesses_v2=raiser(13),
                      nvmlDeviceGetComputeRunningProcesses=lambda h: ["plain"])
    assert Nvml(mod).query("nvmlDeviceGetComputeRunningProcesses_v3", "h") == ["plain"]


def test_missing_function_logged_once(caplog):
    nv = Nvml(fake_module())
    with caplog.at_level(logging.WARNING, logger="gpushare.gres.nvml_query"):
        assert nv.query("nvmlDeviceGetTotalEnergyConsumption", "h") is NA
        assert nv.query("nvmlDeviceGetTotalEnergyConsumption", "h") is NA
    assert len([r for r in caplog.records if "nvmlDeviceGetTotalEnergyConsumption" in r.message]) == 1
    with pytest.raises(GpuError) as err:
        nv.query("nvmlDeviceGetTotalEnergyConsumption", "h", default=RAISE)
    assert err.value.code is NvmlCode.FUNCTION_NOT_FOUND


def _device_module(**overrides):
    mem = types.SimpleNamespace(total=40960 << 20, used=1 << 30, free=(40960 << 20) - (1 << 30))
    proc = types.SimpleNamespace(pid=77, usedGpuMemory=None, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
    funcs = dict(
        nvmlDeviceGetCount_v2=lambda: 1, nvmlDeviceGetHandleByIndex_v2=lambda i: f"h{i}",
        nvmlDeviceGetName=lambda h: b"NVIDIA A100-SXM4-40GB", nvmlDeviceGetUUID=lambda h: "GPU-1234",
        nvmlDeviceGetMemoryInfo=lambda h: mem, nvmlDeviceGetMinorNumber=lambda h: 0,
        nvmlDeviceGetMigMode=lambda h: [0, 1], nvmlDeviceGetComputeRunningProcesses_v3=lambda h: [proc],
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=75, memory=20),
        nvmlDeviceGetPowerUsage=lambda h: 250_500, nvmlDeviceGetTotalEnergyConsumption=raiser(3),
    )
    funcs.update(overrides)
    return fake_module(**funcs)


def test_backend_translates_structs():
    b = NvmlBackend(_device_module())
    g = b.gpu(0)
    assert (g.model, g.uuid, g.mig_current, g.mig_pending) == ("a100-40gb", "GPU-1234", False, True)
    assert b.memory(0).used == 1 << 30
    [p] = b.processes(0)
    assert p.pid == 77 and p.used_bytes is NA and p.gpu_instance_id is None
    u = b.utilization(0)
    assert (u.source, u.gpu, u.memory, u.smact) == ("nvml", 0.75, 0.20, NA)
    assert b.power_watts(0) == 250.5
    assert b.energy_mj(0) is NA  # e.g. a pre-Volta GPU


def test_backend_uses_dcgm_when_given():
    b = NvmlBackend(_device_module(), dcgm=lambda i: (0.9, 0.5, 0.4))
    u = b.utilization(0)
    assert (u.source, u.smact, u.smocc, u.drama) == ("dcgm", 0.9, 0.5, 0.4)


def test_lost_gpu_raises_from_backend():
    b = NvmlBackend(_device_module(nvmlDeviceGetMemoryInfo=raiser(15)))
    with pytest.raises(GpuError) as err:
        b.memory(0)
    assert err.value.gpu_lost


def test_match_model_prefers_longest_name():
    assert match_model("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert match_model("NVIDIA H200 NVL") == "h200-141gb"
    assert match_model("Some Other GPU") is None


def test_read_mig_minors(tmp_path):
    path = tmp_path / "mig-minors"
    path.write_text("config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n")
    assert read_mig_minors(path)["gpu0/gi1/ci0/access"] == 13
    assert read_mig_minors(tmp_path / "missing") == {}


def test_missing_binding_is_a_clear_gpu_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # "import pynvml" now raises ImportError
    with pytest.raises(GpuError) as err:
        Nvml().query("nvmlDeviceGetCount_v2")
    assert err.value.code is NvmlCode.LIBRARY_NOT_FOUND
    assert "NVML not available" in str(err.value) and "slurm-gpushare[node]" in str(err.value)
