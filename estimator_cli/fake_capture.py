"""Fake-mode recorder: every storage the GPU side of the script creates, in order, with its free.

A TorchDispatchMode sees each aten op below autograd (so backward's allocations too). GPU tensors live
on ``meta`` (estimator_cli/device_mode.py), so a meta storage not seen before is a new GPU allocation; a
weak reference with a finalizer on the storage records its free when its last user lets go — the same
moment the CUDA caching allocator would get the block back. Pattern from PyTorch's
``torch/distributed/_tools/mem_tracker.py`` (weak-keyed storages, finalizers).

Tensors the script itself puts on ``meta`` are not GPU memory: transformers, accelerate's
``init_empty_weights`` and ``torch.device("meta")`` build a model's skeleton there before its weights are
loaded, and on a GPU that skeleton costs nothing. The device presenter says where each call places its
outputs (:func:`placing`): ``"meta"`` for an explicit ``device="meta"`` (argument, default-device context,
``.to("meta")``), ``"gpu"`` for a request for the GPU (``to_empty(device="cuda")`` of a skeleton is a
real allocation), otherwise the outputs follow their inputs — an op whose meta inputs are all the
script's own (``w.t()``, ``zeros_like(w)``) makes the script's own meta too. Those storages are kept in
a weak registry (:func:`is_script_meta`) and never recorded.

Known limitations: in-place ``resize_`` of an existing storage is not seen as a new allocation;
storages created by C++ outside the dispatcher (none in stock PyTorch training paths) are missed.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from gpushare.estimator_cli.conv_workspace import geometries_for
from gpushare.estimator_cli.events import DEFAULT_KIND, Alloc, ConvGeometry, Kind, Phase
from gpushare.estimator_cli.meta_cache import MetaCache
from gpushare.estimator_cli.reduce_buffer import geometry_of


# Storages of the meta tensors the script placed on ``meta`` itself (see the module docstring), weakly keyed
# like weight_files.py's host weights; the placement of the call in progress is per thread (transformers
# loads in a thread pool).
_script_meta: WeakIdKeyDictionary = WeakIdKeyDictionary()
_placement = threading.local()


def set_placement(where: str | None) -> str | None:
    """Outputs of the calls from now on go to ``"meta"`` (the script's own), ``"gpu"``, or (None) follow
    their inputs; returns the placement it replaces."""
    saved: str | None = getattr(_placement, "where", None)
    _placement.where = where
    return saved


@contextlib.contextmanager
def placing(where: str | None) -> Iterator[None]:
    """:func:`set_placement` for the calls inside."""
    saved = set_placement(where)
    try:
        yield
    finally:
        set_placement(saved)


@contextlib.contextmanager
def counted_as_gpu() -> Iterator[None]:
    """Meta tensors made inside are GPU memory even where they are asked for on ``meta``: a weight file's
    host weights (estimator_cli/weight_files.py), which fake mode counts from the moment they are loaded."""
    saved = getattr(_placement, "counted", False)
    _placement.counted = True
    try:
        yield
    finally:
        _placement.counted = saved


def is_script_meta(value: Any) -> bool:
    return bool(_script_meta) and isinstance(value, torch.Tensor) and value.is_meta \
        and value.untyped_storage() in _script_meta


def _from_script_meta(args: tuple, kwargs: dict) -> bool:
    """Some meta tensor among the inputs, all of them the script's own (top level or one list deep); a
    storage handed over (``set_``) must be the script's own too."""
    seen = False
    for v in (*args, *kwargs.values()):
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.UntypedStorage) and t not in _script_meta:
                return False
            if isinstance(t, torch.Tensor) and t.is_meta:
                if t.untyped_storage() not in _script_meta:
                    return False
                seen = True
    return seen


def _script_placed(args: tuple, kwargs: dict) -> bool:
    if getattr(_placement, "counted", False):
        return False
    where = getattr(_placement, "where", None)
    if where is not None:
        return where == "meta"
    return bool(_script_meta) and _from_script_meta(args, kwargs)


_BASE_DISPATCH = getattr(torch.Tensor.__torch_dispatch__, "__func__", torch.Tensor.__torch_dispatch__)


def _has_own_dispatch(cls: Any) -> bool:
    """A wrapper subclass such as DTensor (not the FakeTensor that compiled regions trace with)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if issubclass(cls, FakeTensor):
        return False
    method = getattr(cls, "__torch_dispatch__", None)
    return method is not None and getattr(method, "__func__", method) is not _BASE_DISPATCH


class FakeRecorder(TorchDispatchMode):
    """Records meta-storage allocations and frees; attributes them via ``context()``."""

    def __init__(self, context: Callable[[], tuple[Phase, int, str]]) -> None:
        super().__init__()
        self.context = context
        self.recording = True
        self.events: list[tuple[str, int]] = []
        self.allocs: dict[int, Alloc] = {}
        self.ids: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> alloc id
        self.live = 0
        self.peak = 0
        self._counter = itertools.count()
        self.cache = MetaCache()

    # -- Recorder protocol --------------------------------------------------------------------
    def event_count(self) -> int:
        return len(self.events)

    def claim(self, tensor: torch.Tensor, kind: Kind, module: str) -> None:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_meta or tensor.layout != torch.strided:
            return
        alloc_id = self.ids.get(tensor.untyped_storage())
        if alloc_id is not None:
            alloc = self.allocs[alloc_id]
            if not alloc.kind or kind in (Kind.GRADIENT, Kind.OPTIMIZER_STATE, Kind.PARAMETER, Kind.BUFFER):
                alloc.kind = kind.value
            if module:
                alloc.module = module

    # -- tracking -----------------------------------------------------------------------------
    def _freed(self, alloc_id: int, size: int) -> None:
        if self.recording:
            self.events.append(("free", alloc_id))
            self.live -= size

    def _track(self, out: Any, op: str, geometries: list[ConvGeometry | None] | None = None,
               reduce: list[int] | None = None) -> None:
        conv_of: dict[int, ConvGeometry] = {}  # id(output tensor) -> geometry, for convolution ops
        if geometries:
            outs = out if isinstance(out, (list, tuple)) else (out,)
            conv_of = {id(t): g for t, g in zip(outs, geometries) if isinstance(t, torch.Tensor) and g is not None}
        if isinstance(out, torch.Tensor):
            leaves: Any = (out,)
        elif isinstance(out, (list, tuple)):
            leaves = [x for x in out if isinstance(x, torch.Tensor)] + [
                y for x in out if isinstance(x, (list, tuple)) for y in x]
        else:
            leaves = tree_leaves(out)
        for t in leaves:
            if not isinstance(t, torch.Tensor) or not t.is_meta or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            if storage in self.ids:
                continue
            size = storage.nbytes()
            alloc_id = next(self._counter)
            self.ids[storage] = alloc_id
            if not self.recording:
                continue
            phase, iteration, module = self.context()
            geometry = conv_of.get(id(t))
            self.allocs[alloc_id] = Alloc(alloc_id, size, module, phase.value, iteration, op,
                                          conv=geometry.to_list() if geometry is not None else None,
                                          reduce=reduce)
            self.events.append(("alloc", alloc_id))
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, alloc_id, size)

    def _skip(self, out: Any) -> None:
        """New meta storages of the script's own meta tensors: registered, never recorded."""
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_meta and t.layout == torch.strided:
                storage = t.untyped_storage()
                if storage not in self.ids:
                    _script_meta[storage] = True

    def replay_alloc(self, template: Alloc, storage: Any) -> int:
        """A block of a fast-forwarded pass (estimator_cli/repeat_passes.py): ``template``'s size, op, module
        and phase in the current iteration; freed by ``replay_free`` or, with a storage, when it dies."""
        alloc_id = next(self._counter)
        _, iteration, _ = self.context()
        self.allocs[alloc_id] = Alloc(alloc_id, template.size, template.module, template.phase, iteration,
                                      template.op, conv=template.conv, reduce=template.reduce)
        self.events.append(("alloc", alloc_id))
        self.live += template.size
        self.peak = max(self.peak, self.live)
        if storage is not None:
            self.ids[storage] = alloc_id
            weakref.finalize(storage, self._freed, alloc_id, template.size)
        return alloc_id

    def replay_free(self, alloc_id: int, size: int) -> None:
        self._freed(alloc_id, size)

    def segment_fingerprint(self, start: int) -> tuple:
        """What the events from ``start`` on allocate and free, independent of block ids: each block's size,
        op, module and phase in order, the frees between two allocations as a sorted run of the freed
        blocks' places in the segment (or sizes of older blocks), and the live memory at the end (phases.py
        compares consecutive micro-steps). The order of frees with no allocation between them changes
        neither the live memory nor the caching allocator's free blocks (neighbours merge either way), and
        it varies from one micro-step to the next with the order in which Python drops references."""
        index: dict[int, int] = {}
        parts: list[tuple] = []
        frees: list[tuple[int, int]] = []
        for what, alloc_id in self.events[start:]:
            alloc = self.allocs[alloc_id]
            if what == "alloc":
                if frees:
                    parts.append(tuple(sorted(frees)))
                    frees = []
                index[alloc_id] = len(index)
                parts.append((alloc.size, alloc.op, alloc.module, alloc.phase))
            else:
                frees.append((index.get(alloc_id, -1), alloc.size if alloc_id not in index else 0))
        if frees:
            parts.append(tuple(sorted(frees)))
        return tuple(parts), self.live

    def segment_rise(self, start: int) -> int:
        """How far the live memory rose above its level at ``start`` during the events from ``start`` on."""
        level = rise = 0
        for what, alloc_id in self.events[start:]:
            size = self.allocs[alloc_id].size
            level += size if what == "alloc" else -size
            rise = max(rise, level)
        return rise

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(_has_own_dispatch(t) for t in types):
            # a tensor subclass (FSDP2's DTensor) decides first; its ops on plain tensors come back here
            return NotImplemented
        out = self.cache.call(func, args, kwargs, lambda: func(*args, **kwargs))
        name = func.__name__
        if _script_placed(args, kwargs):
            self._skip(out)
            return out
        if self.recording:
            self._track(out, name, geometries_for(name, args), geometry_of(name, args))
        else:
            self._track(out, name)
        return out

    def finish(self) -> None:
        """Stop recording and give every unclassified block its phase's default kind."""
        self.recording = False
        for alloc in self.allocs.values():
            if not alloc.kind:
                alloc.kind = DEFAULT_KIND[Phase(alloc.phase)].value
