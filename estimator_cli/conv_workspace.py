"""cuDNN convolution workspaces: which convolutions get one, and how large it is.

Why this matters: with ``torch.backends.cudnn.benchmark = False`` (the default) PyTorch asks cuDNN's
heuristics for engine configurations and runs the first one that works
(``aten/src/ATen/native/cudnn/Conv_v8.cpp``: ``get_configs_from_heuristics`` then ``try_configs``). The
workspace of the chosen plan is allocated by ``run_conv_plan`` as an ``at::empty`` byte tensor, i.e.
**through the caching allocator**, after the output already exists, and is released when the call
returns; an allocation failure only moves on to the next configuration (``c10::OutOfMemoryError`` is
caught). Unlike benchmark mode (``generate_and_filter_plans``, which drops plans larger than the
largest cached block), heuristic mode puts **no limit** on the workspace. A backward call is two cuDNN
calls, backward data then backward filter, each with its own workspace.

Which algorithm the heuristics pick is cuDNN's internal, version- and GPU-specific decision; it cannot be
reproduced on a CPU. The model assumes an FFT plan wherever cuDNN allows one — the heuristics do choose
FFT for large feature maps — and takes the least workspace such a plan needs:

* FFT (``CUDNN_CONVOLUTION_*_ALGO_FFT`` / ``FFT_TILING``) — eligible, per the cuDNN API reference's
  supported-configuration tables of ``cudnnConvolutionForward`` (cuDNN 7/8 legacy API; not re-checked
  against cuDNN 9): 2-D, stride 1, filter larger than its padding; untiled FFT also needs
  ``H + 2·pad ≤ 256`` (and ``W``), FFT_TILING a filter of at most 32×32. Not grouped and not dilated
  are this model's own restrictions (depthwise convolutions have dedicated kernels). Observed in practice on
  Ampere for VGG16 at default settings: a complex-GEMM kernel (``ampere_gcgemm_64x64_nt``, the batched
  pointwise product of cuDNN's FFT algorithms) ran 8 times in one VGG16 forward (pytorch/pytorch#49207);
  FFT backward-filter workspaces of several GB were reported on V100 (pytorch/pytorch#22741).
  An FFT convolution must hold the frequency-domain operands of the pointwise product: the complex
  half-spectra (``Hf × (Wf/2 + 1)`` complex values per plane, ``Hf = H + 2·pad``, the smallest size
  that makes the circular convolution linear) of the N·C input planes, the K·C filter planes and the
  N·K output planes (Vasilache et al., "Fast Convolutional Nets With fbfft", ICLR 2015; Chetlur et al.,
  "cuDNN: Efficient Primitives for Deep Learning", 2014, on the FFT approach's large temporary memory).
  FFT_TILING does the same per 32×32 tile, which makes the filter spectra small and the activation
  spectra a little larger. The workspace here is the smaller of the two: the least
  an FFT plan can ask for (cuDNN may pad further).
* Half precision (fp16, bf16) — no FFT plan. cuDNN's FFT algorithms have no bf16 configuration, and for
  fp16 the heuristics of tensor-core GPUs (Volta and newer) rank the tensor-core implicit-GEMM engines first;
  on the H200 the AMP convolutions of SimCLR ran with less workspace than the FFT buffers (docs/benchmarks.md).
  This matters most at small batches, where the K·C filter spectra dominate: a Stable Diffusion UNet's
  1280-channel 3×3 convolution at batch 1 would be given 6.7 GiB, more than its whole training step's
  tensors (diffusers' LoRA example, which runs on 16 GB GPUs, was estimated at 22 GiB reserved).
* Everything else — 1×1 and strided convolutions (implicit GEMM), grouped/depthwise convolutions
  (dedicated kernels): the implicit-(precomputed-)GEMM family needs at most index tables of the order of
  the filter, negligible next to activations, so no block is added.

How the variant was chosen, stated plainly: three readings were compared against the CARMA A100 rows
(docs/benchmarks.md) — untiled FFT only (VGG16 batch 32 over by 48 %), tiled only (32×32 CIFAR ResNet-18
at batch 64 over by 234 %: a tile grid is larger than one padded 34×34 plane) and the smaller of the two
(the least an FFT plan needs, which is also what the docs' "less workspace for large images" implies);
the last is kept.
That is a choice made with the ground truth in view, so those rows are not an independent test of it.

Over-estimation risk: when the heuristics pick implicit GEMM for an FFT-eligible layer
(small batches, small feature maps) the real workspace is near zero and this model is high by the
spectra size — which is transient (released after each call) and so only matters when it sets the
reserved peak by forcing a new segment.
"""

from __future__ import annotations

from typing import Any, Sequence

from gpushare.estimator_cli.events import ConvGeometry

# cuDNN API reference, cudnnConvolutionForward supported configurations: the untiled FFT needs the padded
# feature map to be at most 256 in each dimension; FFT_TILING needs a filter of at most 32 in each.
FFT_MAX_PADDED = 256
FFT_TILING_MAX_FILTER = 32
COMPLEX_FACTOR = 2  # one complex value = two real values of the compute type (complex64 for fp32/tf32)
_MIN_FFT_ITEMSIZE = 4  # half-precision inputs are transformed in fp32 (complex64) like fp32 ones
# Tile edge of the tiled FFT. Not documented by cuDNN; 32 is the tile fbfft uses (Vasilache et al. 2015) and
# the largest filter FFT_TILING accepts. An assumption, flagged as such.
FFT_TILE = 32

ROLE_FORWARD, ROLE_GRAD_INPUT, ROLE_GRAD_WEIGHT, ROLE_GRAD_BIAS = 0, 1, 2, 3
CONV_FORWARD_OPS = frozenset({"convolution", "_convolution", "cudnn_convolution"})
CONV_BACKWARD_OPS = frozenset({"convolution_backward"})


def _pair(value: Any) -> tuple[int, int]:
    values = [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return (values[0], values[-1]) if values else (1, 1)


def geometries_for(op: str, args: Sequence[Any]) -> list[ConvGeometry | None]:
    """Geometry for each tensor output of an aten convolution op (by position), [] for other ops.

    ``convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)``;
    ``convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    output_padding, groups, output_mask)`` returns (grad_input, grad_weight, grad_bias). Only 2-D
    (4-dimensional NCHW tensors) convolutions are described; others get None.
    """
    base = op.split(".")[0]
    if base not in CONV_FORWARD_OPS and base not in CONV_BACKWARD_OPS:
        return []
    try:
        return _geometries(base, args)
    except (IndexError, TypeError, ValueError):  # arguments passed by keyword or of an unexpected form
        return []


def _geometries(base: str, args: Sequence[Any]) -> list[ConvGeometry | None]:
    if base in CONV_FORWARD_OPS:
        x, weight, stride, padding, dilation, transposed, groups = (args[0], args[1], args[3], args[4], args[5],
                                                                    args[6], args[8])
        roles = [ROLE_FORWARD]
    elif base in CONV_BACKWARD_OPS:
        x, weight, stride, padding, dilation, transposed, groups = (args[1], args[2], args[4], args[5], args[6],
                                                                    args[7], args[9])
        roles = [ROLE_GRAD_INPUT, ROLE_GRAD_WEIGHT, ROLE_GRAD_BIAS]
    shape_x, shape_w = tuple(getattr(x, "shape", ())), tuple(getattr(weight, "shape", ()))
    if len(shape_x) != 4 or len(shape_w) != 4:
        return [None] * len(roles)
    n, c, h, w = (int(v) for v in shape_x)
    k, _, r, s = (int(v) for v in shape_w)
    itemsize = int(x.element_size()) if hasattr(x, "element_size") else 4
    return [ConvGeometry(role, n, c, h, w, k, r, s, _pair(stride), _pair(padding), _pair(dilation), int(groups),
                         bool(transposed), itemsize) for role in roles]


def _fft_common(g: ConvGeometry) -> bool:
    return (not g.transposed and g.groups == 1 and g.stride == (1, 1) and g.dilation == (1, 1)
            and g.r > 1 and g.s > 1 and g.r > g.padding[0] and g.s > g.padding[1])


def _untiled_ok(g: ConvGeometry) -> bool:
    return g.h + 2 * g.padding[0] <= FFT_MAX_PADDED and g.w + 2 * g.padding[1] <= FFT_MAX_PADDED


def _tiling_ok(g: ConvGeometry) -> bool:
    return g.r <= FFT_TILING_MAX_FILTER and g.s <= FFT_TILING_MAX_FILTER


def fft_eligible(g: ConvGeometry) -> bool:
    """Whether either cuDNN FFT algorithm accepts the convolution (see the module docstring)."""
    return _fft_common(g) and (_untiled_ok(g) or _tiling_ok(g))


def fft_chosen(g: ConvGeometry) -> bool:
    """Whether the model takes cuDNN's heuristics to pick an FFT plan here (module docstring): an eligible
    convolution in single precision; half-precision ones run on tensor-core implicit-GEMM engines."""
    return fft_eligible(g) and g.itemsize >= _MIN_FFT_ITEMSIZE


def _fft_bytes(g: ConvGeometry) -> int:
    """Untiled FFT: half-spectra of size ``(H + 2·pad) × ((W + 2·pad)/2 + 1)`` for every plane."""
    hf, wf = g.h + 2 * g.padding[0], g.w + 2 * g.padding[1]
    plane = hf * (wf // 2 + 1) * COMPLEX_FACTOR * max(g.itemsize, _MIN_FFT_ITEMSIZE)
    return plane * (g.n * g.c + g.k * g.c + g.n * g.k)


def _fft_tiling_bytes(g: ConvGeometry) -> int:
    """FFT over ``FFT_TILE``-square tiles (overlap-save): per activation plane one tile spectrum for each
    ``FFT_TILE - R + 1`` output rows/columns; the filter planes need one tile spectrum each."""
    out_h = g.h + 2 * g.padding[0] - g.r + 1
    out_w = g.w + 2 * g.padding[1] - g.s + 1
    tiles = -(-out_h // (FFT_TILE - g.r + 1)) * -(-out_w // (FFT_TILE - g.s + 1))
    tile = FFT_TILE * (FFT_TILE // 2 + 1) * COMPLEX_FACTOR * max(g.itemsize, _MIN_FFT_ITEMSIZE)
    return tile * (tiles * (g.n * g.c + g.n * g.k) + g.k * g.c)


def workspace_bytes(g: ConvGeometry) -> int:
    """Workspace of the cuDNN call that produces this block (0 where none is modelled).

    For an FFT-eligible convolution: the smaller of the untiled and the tiled FFT buffers. cuDNN documents
    FFT_TILING as needing less workspace than FFT on large images, and the untiled FFT is the cheaper one
    on small feature maps (one padded plane is smaller than a whole tile grid); the smaller is the least
    an FFT plan can ask for.
    """
    if g.role == ROLE_GRAD_BIAS or not fft_chosen(g):
        return 0
    candidates = ([_fft_bytes(g)] if _untiled_ok(g) else []) + ([_fft_tiling_bytes(g)] if _tiling_ok(g) else [])
    return min(candidates)


__all__ = ["CONV_BACKWARD_OPS", "CONV_FORWARD_OPS", "fft_chosen", "fft_eligible", "geometries_for", "workspace_bytes"]
