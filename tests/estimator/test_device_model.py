"""The device level: capacities from the one GPU catalogue, context sizes, cuBLAS workspaces."""

from __future__ import annotations

import dataclasses

import pytest

from gpushare.estimator_cli.allocator import CachingAllocatorSim
from gpushare.estimator_cli.device_model import (
    CUBLAS_WORKSPACE_DEFAULT,
    CUBLAS_WORKSPACE_LARGE,
    context_bytes_for,
    cublas_workspace_bytes,
    device_for,
    sm_arch_for,
)
from gpushare.gpus import BUILTIN_GPUS, GiB, GpuModel, KiB, MiB


def test_whole_gpu_capacity_and_architecture_come_from_the_catalogue():
    a100 = device_for("a100-40gb")
    assert a100.capacity_bytes == BUILTIN_GPUS["a100-40gb"].total_bytes == 40960 * MiB
    assert (a100.sm_arch, a100.sm_count, a100.is_mig) == ((8, 0), 108, False)
    h100 = device_for("H100-80GB")  # names are case-insensitive, as in gpushare.gpus.parse_target
    assert (h100.name, h100.sm_arch) == ("h100-80gb", (9, 0))
    assert device_for("h200-141gb").sm_arch == (9, 0)
    assert device_for("v100-32gb").sm_arch == (7, 0)


def test_mig_slice_capacity_is_the_profile_usable_memory():
    d = device_for("a100-40gb:3g.20gb")
    profile = BUILTIN_GPUS["a100-40gb"].mig_profile("3g.20gb")
    assert d.is_mig and d.name == "a100-40gb:3g.20gb"
    assert d.capacity_bytes == profile.usable_bytes == int(19.5 * GiB)
    assert d.sm_count == 42
    assert d.allocatable_bytes == d.capacity_bytes - d.context_bytes


def test_unknown_targets_name_the_known_ones():
    with pytest.raises(ValueError, match="known:"):
        device_for("a200-40gb")
    with pytest.raises(ValueError, match="no MIG profile"):
        device_for("a100-40gb:9g.99gb")


def test_cublas_workspace_defaults_per_architecture():
    # ":4096:2:16:8" = 2 x 4 MiB + 8 x 16 KiB before Hopper; ":4096:8" = 32 MiB on Hopper/Blackwell.
    assert CUBLAS_WORKSPACE_DEFAULT == 8_519_680
    assert device_for("a100-80gb").cublas_workspace_bytes == CUBLAS_WORKSPACE_DEFAULT
    assert device_for("h100-80gb").cublas_workspace_bytes == CUBLAS_WORKSPACE_LARGE == 32 * MiB
    assert cublas_workspace_bytes((10, 0)) == 32 * MiB


def test_cublas_workspace_config_override():
    assert cublas_workspace_bytes((8, 0), ":4096:8") == 32 * MiB
    assert cublas_workspace_bytes((9, 0), ":16:8") == 128 * KiB  # the deterministic-mode setting
    assert cublas_workspace_bytes((8, 0), ":4096:2:16:8") == CUBLAS_WORKSPACE_DEFAULT
    assert cublas_workspace_bytes((8, 0), "garbage") == CUBLAS_WORKSPACE_DEFAULT  # PyTorch warns, keeps default
    assert device_for("a100-40gb", cublas_workspace_config=":16:8").cublas_workspace_bytes == 128 * KiB


def test_cublas_workspace_goes_through_the_caching_allocator():
    # 8,519,680 B is a large-pool request under 10 MiB: it costs a whole 20 MiB segment on first use.
    d = device_for("a100-40gb")
    s = CachingAllocatorSim(d.capacity_bytes, reserved_elsewhere=d.context_bytes)
    s.malloc(d.cublas_workspace_bytes)
    assert (s.allocated_bytes, s.reserved_bytes) == (CUBLAS_WORKSPACE_DEFAULT, 20 * MiB)


def test_context_size_is_in_the_published_range_and_grows_with_libraries():
    for target in ("a100-40gb", "h100-80gb", "rtx3060-12gb", "l40s-48gb"):
        d = device_for(target, uses_cudnn=False, uses_cublas=False)
        assert 250 * MiB <= d.context_bytes <= 640 * MiB  # lazy loading: ~270-520 MiB published, 610 on an H200
    arch = (8, 0)
    bare = context_bytes_for(arch, uses_cublas=False, uses_cudnn=False)
    assert bare < context_bytes_for(arch, uses_cudnn=False) < context_bytes_for(arch)
    assert device_for("h100-80gb").context_bytes > device_for("a100-80gb").context_bytes


def test_hopper_context_is_the_h200_measurement():
    """gpushare/cuda_context.py: NVML used minus torch's reserved on an H200 (docs/benchmarks.md): 610 MiB bare,
    742 MiB over training scripts without convolutions, 758-762 MiB with them."""
    assert context_bytes_for((9, 0), uses_cublas=False, uses_cudnn=False) == 610 * MiB
    assert device_for("h200-141gb", uses_cudnn=False).context_bytes == 742 * MiB
    assert device_for("h100-80gb").context_bytes == 762 * MiB


def test_cublaslt_workspace_only_when_not_unified():
    """One 1 MiB block per process on the H200 with PyTorch 2.11 (device_model.py says where)."""
    assert device_for("a100-40gb").cublaslt_workspace_bytes == MiB
    assert device_for("h200-141gb", cublaslt_workspace_size="4096").cublaslt_workspace_bytes == 4 * MiB
    assert device_for("h200-141gb", cublaslt_workspace_size="lots").cublaslt_workspace_bytes == MiB
    assert device_for("a100-40gb", cublaslt_unified="1").cublaslt_workspace_bytes == 0
    assert device_for("a100-40gb", cublaslt_unified="0").cublaslt_workspace_bytes == MiB


def test_site_added_models_from_a_config_catalogue():
    h800 = GpuModel("h800-80gb", "NVIDIA H800", 81559 * MiB, 132)
    odd = GpuModel("mystery-16gb", "Some Future GPU", 16 * GiB, 40)
    catalogue = {**BUILTIN_GPUS, h800.name: h800, odd.name: odd}
    d = device_for("h800-80gb", catalogue)
    assert (d.capacity_bytes, d.sm_arch, d.cublas_workspace_bytes) == (81559 * MiB, (9, 0), 32 * MiB)
    assert sm_arch_for(odd) == (8, 0)  # unknown names fall back to Ampere defaults
    assert device_for("mystery-16gb", catalogue).capacity_bytes == 16 * GiB


def test_device_model_is_immutable():
    d = device_for("a30-24gb:2g.12gb")
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.capacity_bytes = 0  # type: ignore[misc]
