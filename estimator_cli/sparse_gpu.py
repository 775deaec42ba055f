"""Sparse GPU tensors in fake mode: real CPU sparse tensors that count as GPU memory.

Why: on ``meta`` a sparse tensor loses its entries (``to('meta')`` keeps no ``nnz``), and the sparse
kernels GNNs use (``torch.sparse.mm``, ``sparse @ dense``) have no SparseMeta implementation. So a sparse
tensor moved to the GPU stays a CPU sparse tensor — its indices and values are what the script built on
the host anyway, usually an adjacency matrix — and a meta copy of each component is made and kept alive
with it, so the recorder sees the GPU allocation and its free. In an operation with GPU (meta) tensors
the sparse operand is replaced by a zero-stride dense stand-in of its shape: the output's shape, dtype
and autograd edges to the dense operands are those of the real call (``sparse @ dense`` has the dense
result and dense gradient of ``dense @ dense``), while CUDA's sparse kernels' own temporaries
(cuSPARSE buffers) are not modelled. Operations on sparse tensors alone run on the CPU and stay "on the
GPU".
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from gpushare.estimator_cli.tensor_parts import dense_parts


class SparseOnGpu:
    def __init__(self) -> None:
        self.placed: WeakIdKeyDictionary = WeakIdKeyDictionary()  # CPU sparse tensor -> its meta components

    def __contains__(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.layout != torch.strided and t in self.placed

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """``t.to('cuda')`` of a sparse tensor: itself, now counted as GPU memory."""
        if t not in self.placed:
            self.placed[t] = [torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta")
                              for p in dense_parts(t)]
        return t

    def involved(self, args: tuple, kwargs: dict) -> bool:
        return any(a in self for a in args) or any(v in self for v in kwargs.values())

    def call(self, func: Callable[..., Any], args: tuple, kwargs: dict,
             rewrite: Callable[[Any], tuple[Any, bool]]) -> Any:
        metas = any(isinstance(a, torch.Tensor) and a.is_meta for a in (*args, *kwargs.values()))
        if not metas:
            if func in (torch.Tensor.to, torch.Tensor.cuda):  # already "on the GPU"
                return args[0]
            with _disable_current_modes():
                out = func(*args, **{k: v for k, v in kwargs.items() if k != "device"})
            if isinstance(out, torch.Tensor) and out.layout != torch.strided:
                return self.place(out)
            if isinstance(out, torch.Tensor):  # e.g. to_dense(): a dense GPU tensor
                return out.to("meta")
            return out

        def standin(v: Any) -> Any:
            if v in self:
                return torch.empty((), dtype=v.dtype, device="meta").expand(v.shape)
            return v
        return func(*[standin(a) for a in args], **{k: standin(v) for k, v in kwargs.items()})
