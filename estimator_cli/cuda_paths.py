"""The CUDA-only code paths that fake capture must take by hand: autocast on ``cuda`` and SDPA kernels.

Why: in fake mode GPU tensors live on PyTorch's ``meta`` device (estimator_cli/device_mode.py says why).
Meta tensors carry no AutocastCUDA dispatch key and SDPA on meta picks the *math* kernel, which keeps an
O(seq²) attention matrix a GPU never materialises. So, at the torch-function level (above autograd, so
casts are recorded and saved for backward exactly as real autocast's are), this module:

- casts inputs of the ops CUDA autocast runs in lower precision, caching casts of leaf parameters for the
  duration of the autocast region as ``at::autocast::cached_cast`` does, and up-casts the ops CUDA autocast
  runs in float32. Op lists: PyTorch ``aten/src/ATen/autocast_mode.cpp`` (``AT_FORALL_LOWER_PRECISION_FP``,
  ``AT_FORALL_FP32``), restricted to what is visible as a torch function;
- routes ``scaled_dot_product_attention`` to the flash or memory-efficient kernel with the conditions of
  ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (flash: sm80+, fp16/bf16, head dim ≤ 256 and a
  multiple of 8, no explicit mask; efficient: sm50+, head dim a multiple of 8 (4 for fp32));
- runs Python composites whose body holds such ops (``F.multi_head_attention_forward``, the whole of
  ``nn.MultiheadAttention`` and so of ``nn.Transformer*``) with the presenter active inside them. A torch
  function mode is switched off while its handler runs, so without this the body's projections would miss
  autocast and its SDPA the kernel routing: measured on an H200 (docs/benchmarks.md, *Ground truth on a real
  GPU*), a Lightning transformer encoder was estimated at 6.1 GiB reserved against 2.9 GiB on the GPU.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

_LOWER = {
    torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d,
    torch.conv_transpose3d, torch.convolution, torch.prelu, torch.addmm, torch.addmv, torch.addr,
    torch.matmul, torch.einsum, torch.mm, torch.mv, torch.addbmm, torch.baddbmm, torch.bmm,
    torch.chain_matmul, torch._C._nn.linear, torch.Tensor.matmul, torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__, torch.Tensor.mm, torch.Tensor.bmm, torch.Tensor.addmm, torch.Tensor.baddbmm,
}
_FP32 = {
    torch.acos, torch.asin, torch.cosh, torch.erfinv, torch.exp, torch.expm1, torch.log, torch.log10,
    torch.log2, torch.log1p, torch.reciprocal, torch.rsqrt, torch.sinh, torch.tan, torch.pow,
    torch._C._nn.softplus, torch.layer_norm, torch.group_norm, torch.cosine_similarity,
    # torch's _C/_nn.pyi stub omits nll_loss and nll_loss2d; both exist at run time
    torch._C._nn.nll_loss, torch._C._nn.nll_loss2d,  # type: ignore[attr-defined]
    torch._C._nn.l1_loss, torch._C._nn.smooth_l1_loss,
    torch._C._nn.huber_loss, torch._C._nn.mse_loss, torch._C._nn.cross_entropy_loss,
    torch.binary_cross_entropy_with_logits, torch.kl_div, torch.cdist, torch.logsumexp, torch.softmax,
    torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax, torch.Tensor.exp, torch.Tensor.log,
    torch.Tensor.pow, torch.Tensor.rsqrt,
}


class AutocastEmulator:
    """Applies CUDA autocast rules to GPU-side tensors (meta in fake mode, CPU in profile mode: neither has
    the AutocastCUDA key) while ``torch.is_autocast_enabled('cuda')``."""

    def __init__(self, real_cpu: bool = False) -> None:
        # id(weight) -> (weight, its cast): autocast's weight-cast cache, freed when autocast is left
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Profile mode computes for real on the CPU, where float16 GEMMs are very slow (measured: an AMP
        # step over 300 s); bfloat16 has the same size, so memory is unchanged and the kernels are fast.
        self._fp16_as = torch.bfloat16 if real_cpu else torch.float16

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == dtype:
            return value
        if value.dtype == torch.float64:  # autocast leaves float64 alone
            return value
        if value.is_leaf and value.requires_grad and dtype != torch.float32:
            hit = self.cache.get(id(value))
            if hit is not None and hit[0] is value:
                return hit[1]
            cast = value.to(dtype)
            self.cache[id(value)] = (value, cast)  # the pair keeps `value` alive, so ids stay unique
            return cast
        return value.to(dtype)

    def rewrite(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not torch.is_autocast_enabled("cuda"):
            if self.cache:
                self.cache.clear()  # autocast exit frees the cached weight casts
            return args, kwargs
        if func in _LOWER or func in SDPA_FUNCS:
            dtype = torch.get_autocast_dtype("cuda")
            dtype = self._fp16_as if dtype == torch.float16 else dtype
        elif func in _FP32:
            dtype = torch.float32
        else:
            return args, kwargs
        args = tuple(self._cast(a, dtype) for a in args)
        if func in _LOWER or func in SDPA_FUNCS:  # linear's bias, SDPA's attn_mask come as keywords too
            kwargs = {k: self._cast(v, dtype) for k, v in kwargs.items()}
        return args, kwargs


_META_LIBRARY: list[Any] = []  # the torch.library.Library holding the kernels below, alive for the process


def _efficient_meta(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: Any,
                    compute_log_sumexp: bool, dropout_p: float = 0.0, is_causal: bool = False,
                    scale: Any = None) -> tuple[torch.Tensor, ...]:
    """Shapes of the memory-efficient kernel's outputs (PyTorch's own meta kernel from 2.5 on)."""
    batch, heads, length, value_dim = query.size(0), query.size(1), query.size(2), value.size(-1)
    out = torch.empty(batch, length, heads, value_dim, dtype=query.dtype, device=query.device).transpose(1, 2)
    lse = torch.empty(batch, heads, -(-length // 32) * 32 if compute_log_sumexp else 0, dtype=torch.float,
                      device=query.device)
    return out, lse, torch.empty((), dtype=torch.long, device="meta"), torch.empty((), dtype=torch.long, device="meta")


def _flash_meta(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                is_causal: bool = False, return_debug_mask: bool = False, scale: Any = None) -> tuple[Any, ...]:
    """Shapes of the flash kernel's outputs (PyTorch's own meta kernel from 2.5 on)."""
    batch, heads, length = query.size(0), query.size(1), query.size(2)
    out = torch.empty_like(query.transpose(1, 2)).transpose(1, 2)
    lse = torch.empty(batch, heads, length, dtype=torch.float, device=query.device)
    none = torch.empty(0, dtype=torch.int32, device=query.device)
    seed = torch.empty((), dtype=torch.long, device="meta")
    return (out, lse, none, none, length, key.size(2), seed, torch.empty((), dtype=torch.long, device="meta"),
            torch.empty(0, dtype=query.dtype, device=query.device))


def ensure_sdpa_meta() -> None:
    """PyTorch 2.4 has no meta kernels for the flash and memory-efficient SDPA forwards (their backwards have
    them); register the shapes newer releases use, so fake mode captures attention under the user's 2.4 too
    (gpu-estimate --python). Nothing is registered where PyTorch has its own."""
    if _META_LIBRARY:
        return
    library = torch.library.Library("aten", "IMPL")
    _META_LIBRARY.append(library)
    for name, kernel in (("_scaled_dot_product_efficient_attention", _efficient_meta),
                         ("_scaled_dot_product_flash_attention", _flash_meta)):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
            library.impl(name, kernel, "Meta")


def _autocast_input(value: Any, dtype: torch.dtype) -> Any:
    """What CUDA autocast's lower-precision cast makes of one input (float64 and non-float left alone)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype not in (dtype, torch.float64):
        return value.to(dtype)
    return value


def route_sdpa(sm_major: int, args: tuple, kwargs: dict) -> Any:
    """Call the SDPA kernel CUDA would pick, so saved tensors match the GPU's (O(seq), not O(seq²))."""
    ensure_sdpa_meta()
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    mask, dropout = bound.get("attn_mask"), bound.get("dropout_p", 0.0)
    causal, scale = bound.get("is_causal", False), bound.get("scale")
    if torch.is_autocast_enabled("cuda"):
        # CUDA autocast casts every floating input of SDPA (lower_precision_fp list), a float mask included;
        # the fallback below gets the cast arguments too, or Llama-style attention (q, k float32 after the
        # rotary embedding, v half) fails with a dtype mismatch
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = (_autocast_input(t, dtype) for t in (q, k, v))
        mask = _autocast_input(mask, dtype)
        bound.update(query=q, key=k, value=v, attn_mask=mask)
        args, kwargs = (), bound
    head = q.shape[-1]
    same_heads = q.dim() == 4 and k.shape[-1] == head and v.shape[-1] == head and not bound.get("enable_gqa")
    if (same_heads and sm_major >= 8 and q.dtype in (torch.float16, torch.bfloat16) and mask is None
            and head <= 256 and head % 8 == 0):
        out = torch.ops.aten._scaled_dot_product_flash_attention.default(
            q, k, v, dropout, causal, False, scale=scale)
        return out[0]
    if same_heads and sm_major >= 5 and head % (4 if q.dtype == torch.float32 else 8) == 0:
        need_lse = q.requires_grad or k.requires_grad or v.requires_grad
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        out = torch.ops.aten._scaled_dot_product_efficient_attention.default(
            q, k, v, mask, need_lse, dropout, causal, scale=scale)
        return out[0]
    return F.scaled_dot_product_attention(*args, **kwargs)


SDPA_FUNCS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
# Python composites that dispatch through ``has_torch_function`` (the variadic check, looked up in
# torch.nn.functional's globals) and whose body holds autocast ops and SDPA.
COMPOSITES = {F.multi_head_attention_forward}


def run_composite(mode: Any, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run ``func``'s body with ``mode`` active, from inside ``mode``'s own handler.

    The handler runs with the mode popped; pushing it again and calling ``func`` would dispatch straight back
    to the handler, since the body starts with ``if has_torch_function(...)``. That check alone is answered
    "no" for the duration of the call (the inner ops use their own unary/variadic checks or C++ dispatch,
    which still reach the mode). The capture runs the script on one thread (the DataLoader runs in-process).
    """
    saved = F.has_torch_function  # type: ignore[attr-defined]
    F.has_torch_function = lambda *_: False  # type: ignore[attr-defined]
    try:
        with mode:
            return func(*args, **kwargs)
    finally:
        F.has_torch_function = saved  # type: ignore[attr-defined]


def run_backward(mode: Any, args: tuple, kwargs: dict) -> Any:
    """``Tensor.backward`` with ``mode`` active inside it, from ``mode``'s own handler.

    Why: FSDP2 gathers parameters in a pre-backward hook (``torch.empty(..., device="cuda")`` from Python,
    run by the autograd engine); a handler runs with its mode popped, so without this those requests reached
    the CPU build's missing CUDA backend. The mode is pushed as it is (its ``__enter__`` installs hooks once)
    and ``torch.autograd``'s own torch-function check answered "no" for the call, as in ``run_composite``."""
    import torch.autograd as autograd

    names = ("gradient", "retain_graph", "create_graph", "inputs")
    bound = dict(zip(names, args[1:]))
    bound.update(kwargs)
    saved = autograd.has_torch_function  # type: ignore[attr-defined]
    autograd.has_torch_function = lambda *_: False  # type: ignore[attr-defined]
    torch._C._push_on_torch_function_stack(mode)
    try:
        return torch.autograd.backward(args[0], bound.get("gradient"), bound.get("retain_graph"),
                                       bound.get("create_graph", False), inputs=bound.get("inputs"))
    finally:
        torch._C._pop_torch_function_stack()
        autograd.has_torch_function = saved  # type: ignore[attr-defined]
