"""The storages behind a tensor, sparse layouts included.

Why: a sparse tensor has no storage of its own (``untyped_storage()`` raises "Cannot access storage of
SparseTensorImpl"); its memory is that of its component tensors — indices and values for COO, compressed
and plain indices and values for CSR/CSC/BSR/BSC — each a dense tensor with a storage the allocator
sees. Tagging and attribution go through this so a GNN's adjacency matrix is counted, not a crash.
"""

from __future__ import annotations

import torch

_COMPRESSED = {torch.sparse_csr: ("crow_indices", "col_indices"), torch.sparse_bsr: ("crow_indices", "col_indices"),
               torch.sparse_csc: ("ccol_indices", "row_indices"), torch.sparse_bsc: ("ccol_indices", "row_indices")}


def dense_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """``[t]`` for a strided tensor; the component tensors of a sparse one."""
    if t.layout == torch.strided:
        return [t]
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    names = _COMPRESSED.get(t.layout)
    if names is None:
        return []
    return [getattr(t, names[0])(), getattr(t, names[1])(), t.values()]


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    return [part.untyped_storage() for part in dense_parts(t)]
