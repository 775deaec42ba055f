"""Choosing the backend from a spec or GPUSHARE_DEVICE_BACKEND."""

from __future__ import annotations

import pytest

from gpushare.gres.factory import ENV_VAR, open_backend
from gpushare.gres.nvml_backend import NvmlBackend
from gpushare.gres.sim_backend import SimBackend


def test_nvml_by_default(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert isinstance(open_backend(), NvmlBackend)  # opening never touches the driver


def test_sim_from_spec_and_env(tmp_path, monkeypatch, clock):
    path = tmp_path / "s.json"
    SimBackend.from_scenario({"version": 1, "gpus": [{"model": "a30-24gb"}]}, path, clock=clock)
    assert open_backend(f"sim:{path}").gpu_count() == 1
    monkeypatch.setenv(ENV_VAR, f"sim:{path}")
    backend = open_backend(clock=clock)
    assert backend.name == "sim" and backend.now() == 0


@pytest.mark.parametrize("spec", ["sim", "sim:", "cuda", "nvml:x"])
def test_bad_spec(spec, monkeypatch):
    with pytest.raises(ValueError, match="use 'nvml' or 'sim:"):
        open_backend(spec)
    monkeypatch.setenv(ENV_VAR, spec)
    with pytest.raises(ValueError, match=ENV_VAR):
        open_backend()
