"""The shim's own CUDA declarations (gres/hardcap/cuda_types.h) against NVIDIA's cuda.h, from the
nvidia-cuda-runtime-cu12 wheel (installed: its ``nvidia/cuda_runtime/include``; or a directory named by
GPUSHARE_CUDA_INCLUDE). Skipped where neither is present."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.hardcap

HERE = Path(__file__).parent


def cuda_include() -> Path | None:
    named = os.environ.get("GPUSHARE_CUDA_INCLUDE")
    if named:
        return Path(named)
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        if (Path(base) / "cuda_runtime/include/cuda.h").is_file():
            return Path(base) / "cuda_runtime/include"
    return None


def test_declared_types_match_cuda_h(tmp_path: Path) -> None:
    include = cuda_include()
    if include is None or not shutil.which("gcc"):
        pytest.skip("cuda.h (pip install nvidia-cuda-runtime-cu12) or gcc absent")
    out = subprocess.run(["gcc", "-I", str(include), "-I", str(HERE.parents[1] / "gres/hardcap"), "-o",
                          str(tmp_path / "check"), str(HERE / "cuda_types_check.c")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_declared_nvml_types_match_nvml_h(tmp_path: Path) -> None:
    spec = importlib.util.find_spec("nvidia")
    found = [Path(b) / "nvml_dev/include" for b in ((spec.submodule_search_locations or []) if spec else [])
             if (Path(b) / "nvml_dev/include/nvml.h").is_file()]
    if not found or not shutil.which("gcc"):
        pytest.skip("nvml.h (pip install nvidia-nvml-dev-cu12) or gcc absent")
    out = subprocess.run(["gcc", "-I", str(found[0]), "-I", str(HERE.parents[1] / "gres/hardcap"), "-o",
                          str(tmp_path / "check"), str(HERE / "nvml_types_check.c")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
