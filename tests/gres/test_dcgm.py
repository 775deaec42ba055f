"""DCGM utilisation source: field mapping, caching on a fake clock, fallback to NVML when DCGM is down."""

from __future__ import annotations

import types

from gpushare.gres import NA
from gpushare.gres.dcgm import DRAMA, SMACT, SMOCC, DcgmSource, dcgm_source
from gpushare.gres.nvml_backend import NvmlBackend


class FakeReader:
    def __init__(self, data):
        self.data = data
        self.calls = 0

    def GetLatestGpuValuesAsFieldIdDict(self):
        self.calls += 1
        if isinstance(self.data, Exception):
            raise self.data
        return self.data


def test_fields_mapped_and_blank_is_na(clock):
    reader = FakeReader({0: {SMACT: 0.9, SMOCC: 0.5, DRAMA: 0.4}, 1: {SMACT: 0.2}})
    src = DcgmSource(lambda: reader, clock=clock)
    assert src(0) == (0.9, 0.5, 0.4)
    assert src(1)[0] == 0.2 and src(1)[1] is NA
    assert src(5) is None
    assert reader.calls == 1  # one query serves every GPU within max_age_s
    clock.advance(1)
    src(0)
    assert reader.calls == 2


def test_dcgm_down_falls_back_to_nvml(clock):
    src = DcgmSource(lambda: FakeReader(RuntimeError("connection not valid")), clock=clock)
    assert src(0) is None
    mod = types.ModuleType("fake")
    mod.NVMLError = RuntimeError
    mod.nvmlInit = mod.nvmlShutdown = lambda: None
    mod.nvmlDeviceGetHandleByIndex_v2 = lambda i: i
    mod.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=40, memory=10)
    u = NvmlBackend(mod, dcgm=src).utilization(0)
    assert (u.source, u.gpu, u.smact) == ("nvml", 0.4, NA)


def test_no_bindings_means_no_source(monkeypatch):
    import sys

    import gpushare.gres.dcgm as dcgm

    monkeypatch.setattr(dcgm, "BINDING_DIRS", ())
    monkeypatch.setitem(sys.modules, "DcgmReader", None)  # import fails as without the package
    assert dcgm_source() is None
