"""cuDNN workspace model (estimator_cli/conv_workspace.py) and the convolution geometry in captures."""

from __future__ import annotations

import dataclasses

import torch

from gpushare.estimator_cli.conv_workspace import fft_eligible, geometries_for, workspace_bytes
from gpushare.estimator_cli.events import Alloc, Capture, ConvGeometry
from gpushare.estimator_cli.orchestrate import orchestrate


def _geometry(role: int = 0, n: int = 8, c: int = 64, hw: int = 56, k: int = 64, rs: int = 3, stride: int = 1,
              pad: int = 1, groups: int = 1) -> ConvGeometry:
    return ConvGeometry(role, n, c, hw, hw, k, rs, rs, (stride, stride), (pad, pad), (1, 1), groups, False, 4)


def test_geometry_from_aten_arguments() -> None:
    x, w = torch.empty(8, 3, 32, 32, device="meta"), torch.empty(16, 3, 3, 3, device="meta")
    fwd = geometries_for("convolution.default", (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
    assert fwd == [ConvGeometry(0, 8, 3, 32, 32, 16, 3, 3, (1, 1), (1, 1), (1, 1), 1, False, 4)]
    dy = torch.empty(8, 16, 32, 32, device="meta")
    bwd = geometries_for("convolution_backward.default",
                         (dy, x, w, [16], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]))
    assert [g.role for g in bwd] == [1, 2, 3]
    assert geometries_for("addmm.default", ()) == []
    assert geometries_for("convolution.default", (x,)) == []  # unexpected arguments: no geometry, no crash


def test_geometry_survives_the_capture_json() -> None:
    geometry = _geometry()
    cap = Capture(mode="fake", steps=1, stopped=True, events=[("alloc", 0), ("alloc", 1)],
                  allocs={0: Alloc(0, 100, "m", "forward", 0, "convolution.default", "activation", geometry.to_list()),
                          1: Alloc(1, 100, "m", "forward", 0, "relu.default", "activation")})
    back = Capture.from_json(cap.to_json())
    assert ConvGeometry.from_list(back.allocs[0].conv) == geometry
    assert back.allocs[1].conv is None


def test_fft_eligibility_follows_the_documented_preconditions() -> None:
    assert fft_eligible(_geometry())
    assert not fft_eligible(_geometry(rs=1, pad=0))  # 1x1: implicit GEMM
    assert not fft_eligible(_geometry(stride=2))
    assert not fft_eligible(_geometry(groups=64))  # depthwise
    assert fft_eligible(_geometry(hw=300))  # padded map over 256: FFT_TILING only
    assert not fft_eligible(_geometry(hw=300, rs=33, pad=1))  # ... and not with a filter over 32


def test_workspace_is_the_smaller_fft_buffer_and_grows_with_batch() -> None:
    small = _geometry(n=1, c=1, k=1, hw=6)  # 8x8 padded plane: 8 * 5 complex64 = 320 bytes per plane
    assert workspace_bytes(small) == 320 * 3
    large = _geometry(n=32, c=64, k=64, hw=224)
    assert workspace_bytes(large) < 226 * 114 * 8 * (32 * 64 * 2 + 64 * 64)  # tiled beats untiled here
    assert workspace_bytes(_geometry(n=64, c=64, k=64, hw=224)) > workspace_bytes(large)
    assert workspace_bytes(_geometry(role=3)) == 0  # grad_bias: no cuDNN convolution


def test_workspace_follows_the_output_and_is_released_at_once() -> None:
    geometry = _geometry()
    cap = Capture(mode="fake", steps=1, stopped=True, events=[("alloc", 0), ("free", 0)],
                  allocs={0: Alloc(0, 4096, "m", "forward", 0, "convolution.default", "activation",
                                   geometry.to_list())})
    events = orchestrate(cap, 0).events
    assert [(op, size) for op, _key, size, _s in events] == [
        ("alloc", 4096), ("alloc", workspace_bytes(geometry)), ("free", 0), ("free", 0)]
    assert events[1][1] == events[2][1]


def test_half_precision_convolutions_get_no_fft_workspace() -> None:
    """fp16 and bf16 convolutions run on tensor-core implicit-GEMM engines (cuDNN's FFT engines have no bf16
    configuration, and the H200 ran SimCLR's AMP convolutions with less than the FFT buffers): a Stable
    Diffusion UNet's 1280-channel 3x3 convolution at batch 1 would otherwise be given a 6.7 GiB workspace."""
    unet = ConvGeometry(0, 1, 1280, 32, 32, 1280, 3, 3, (1, 1), (1, 1), (1, 1), 1, False, 4)
    assert workspace_bytes(unet) > 6 << 30  # fp32: the FFT buffers, K·C filter spectra included
    half = dataclasses.replace(unet, itemsize=2)  # fp16 or bf16
    assert fft_eligible(half) and workspace_bytes(half) == 0
    x, w = torch.empty(1, 1280, 32, 32, device="meta"), torch.empty(1280, 1280, 3, 3, device="meta")
    for dtype in (torch.float16, torch.bfloat16):
        (g,) = geometries_for("convolution.default", (x.to(dtype), w.to(dtype), None, [1, 1], [1, 1], [1, 1], False,
                                                      [0, 0], 1))
        cap = Capture(mode="fake", steps=1, stopped=True, events=[("alloc", 0)],
                      allocs={0: Alloc(0, 2 << 20, "m", "forward", 0, "convolution.default", "activation",
                                       g.to_list())})
        assert [size for _op, _key, size, _s in orchestrate(cap, 0).events] == [2 << 20]
