"""Fast-forward of repeated gradient-free passes (evaluation, warm-up) in fake mode.

Why: scripts often run many identical passes before their first optimizer step — nanoGPT-style trainers
evaluate 200 batches per split at iteration 0, others warm up or prime a model with a few dozen batches.
Their memory matters (the evaluation's peak can be the job's), their repetition does not; yet each pass
costs the full Python and meta-kernel time of a forward (a 12-layer GPT: ~0.1 s), so 400 passes cost
about a minute before the first step is even reached.

What repeats is a call of a *root* module (one called outside any other module's forward) with grad
disabled, the same module state (training flag, hooks) and inputs of the same shapes, dtypes and strides.
Its first two passes run for real; when they allocated the same sequence of blocks (size, op, module), left
nothing alive but their outputs (and the autocast weight casts, which the autocast context frees), read no
GPU value and freed nothing allocated before them, the pass is known: later calls with the same signature
do not run the module. They replay its recorded allocations and frees instead and return fresh meta
tensors of the recorded output shapes, on blocks that are freed when the script drops them, as the real
outputs would be. A replay starting from more live memory than any pass recorded in full so far replays
every block (a script that accumulates outputs on the GPU reaches a new peak each pass); otherwise only
the outputs are allocated, because the same pass from the same or a lower starting point cannot exceed
the peak already recorded.

What is skipped with the module's code: Python side effects inside its forward (prints, counters) and
forward hooks of submodules (a root with hooks of its own is never fast-forwarded). Passes with grad
enabled are never replayed (their autograd graph is needed by backward); profile mode runs every pass.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from gpushare.estimator_cli.events import Alloc

SEEN_BEFORE_REPLAY = 2  # identical recorded passes before later ones are replayed
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device)


@dataclass
class _Leaf:
    """One output leaf: a tensor on a kept block (``block`` is its index in the pass) or a plain value."""

    block: int = -1
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    offset: int = 0
    dtype: torch.dtype | None = None
    value: Any = None


@dataclass
class _Pass:
    """One recorded pass: its blocks in allocation order and the events over them."""

    allocs: list[Alloc]
    trace: list[tuple[bool, int]]  # (is_alloc, block index)
    kept: list[int]  # blocks alive after the pass, in allocation order
    spec: Any
    leaves: list[_Leaf]
    casts: list[tuple[torch.Tensor, _Leaf]]  # autocast weight casts: (weight, the cast's block)
    fingerprint: tuple = ()


@dataclass
class _Entry:
    module: Any  # weakref to the root module
    known: _Pass | None = None
    same: int = 0  # consecutive recorded passes with known's fingerprint
    never: bool = False  # a pass read values or left state behind: always run it
    full_live: int = -1  # the highest starting live memory a pass was recorded or replayed in full from
    replays: int = 0


@dataclass
class RepeatPasses:
    """Patches ``nn.Module.__call__`` for the capture (fake mode only); ``replayed`` counts skipped passes."""

    recorder: Any  # FakeRecorder
    autocast_cache: dict
    reads: Callable[[], int]  # GPU values read with a real value so far
    has_value: Callable[[torch.Tensor], bool]  # a tensor with a concrete value (concrete_values.py)
    entries: dict = field(default_factory=dict)
    replayed: int = 0
    _depth: int = 0
    _saved: Any = None

    def install(self) -> None:
        original = torch.nn.Module.__call__
        self._saved = original
        repeat = self

        def __call__(mod: Any, *args: Any, **kwargs: Any) -> Any:
            if repeat._depth or torch.is_grad_enabled() or not repeat.recorder.recording:
                return original(mod, *args, **kwargs)
            return repeat._call(original, mod, args, kwargs)
        setattr(torch.nn.Module, "__call__", __call__)

    def remove(self) -> None:
        if self._saved is not None:
            setattr(torch.nn.Module, "__call__", self._saved)
            self._saved = None

    # -- one root call -----------------------------------------------------------------------------
    def _call(self, original: Callable[..., Any], mod: Any, args: tuple, kwargs: dict) -> Any:
        key = _signature(mod, args, kwargs, self.autocast_cache)
        entry = self.entries.get(key) if key is not None else None
        if entry is not None and entry.module() is not mod:
            entry = None
            del self.entries[key]
        if entry is not None and entry.known is not None and entry.same >= SEEN_BEFORE_REPLAY and not entry.never \
                and not (mod._forward_hooks or mod._forward_pre_hooks):
            return self._replay(entry)
        start, live_before, reads_before = len(self.recorder.events), self.recorder.live, self.reads()
        cache_before = set(self.autocast_cache)
        self._depth += 1
        try:
            out = original(mod, *args, **kwargs)
        finally:
            self._depth -= 1
        if key is None:
            return out
        if entry is None:
            entry = self.entries[key] = _Entry(weakref.ref(mod))
        if entry.never:
            return out
        recorded = None if self.reads() != reads_before else self._recorded(start, out, cache_before)
        if recorded is None:
            entry.never = True
            return out
        if entry.known is not None and entry.known.fingerprint == recorded.fingerprint:
            entry.same += 1
        else:
            entry.known, entry.same = recorded, 1
        entry.full_live = max(entry.full_live, live_before)
        return out

    def _recorded(self, start: int, out: Any, cache_before: set) -> _Pass | None:
        """The pass's blocks, or None when it is not a self-contained pass (see the module docstring)."""
        events = self.recorder.events[start:]
        index: dict[int, int] = {}
        allocs: list[Alloc] = []
        trace: list[tuple[bool, int]] = []
        for what, alloc_id in events:
            if what == "alloc":
                index[alloc_id] = len(allocs)
                allocs.append(self.recorder.allocs[alloc_id])
                trace.append((True, index[alloc_id]))
            elif alloc_id in index:
                trace.append((False, index[alloc_id]))
            else:
                return None  # freed a block from before the pass: the module changed its state
        freed = {i for is_alloc, i in trace if not is_alloc}
        alive = {i for i in range(len(allocs)) if i not in freed}
        leaves, spec = tree_flatten(out)
        described = [_describe(leaf, self.recorder.ids, index) for leaf in leaves]
        if any(d is None for d in described) or any(isinstance(t, torch.Tensor) and self.has_value(t) for t in leaves):
            return None  # an output with a real value would come back without it
        casts = []
        for weight_id, (weight, cast) in self.autocast_cache.items():
            if weight_id not in cache_before:
                leaf = _describe(cast, self.recorder.ids, index)
                if leaf is None or leaf.block < 0:
                    return None
                casts.append((weight, leaf))
        held = {d.block for d in described if d is not None and d.block >= 0} | {leaf.block for _, leaf in casts}
        if alive != held:
            return None  # something the pass made outlives it besides its outputs: state, a cache
        fingerprint = (tuple(trace), tuple((a.size, a.op, a.module, a.phase) for a in allocs),
                       tuple(sorted(held)), str(spec))
        return _Pass(allocs, trace, sorted(held), spec, [d for d in described if d is not None], casts, fingerprint)

    def _replay(self, entry: _Entry) -> Any:
        known = entry.known
        assert known is not None
        self.replayed += 1
        entry.replays += 1
        storages: dict[int, torch.UntypedStorage] = {}
        with _disable_current_modes(), torch._C.DisableTorchFunction():  # neither the presenter nor the recorder
            for i in known.kept:
                storages[i] = torch.UntypedStorage(known.allocs[i].size, device="meta")
            if self.recorder.live > entry.full_live:
                entry.full_live = self.recorder.live
                ids: dict[int, int] = {}
                for is_alloc, i in known.trace:
                    if is_alloc:
                        ids[i] = self.recorder.replay_alloc(known.allocs[i], storages.get(i))
                    elif i not in storages:
                        self.recorder.replay_free(ids[i], known.allocs[i].size)
            else:
                for i in known.kept:
                    self.recorder.replay_alloc(known.allocs[i], storages[i])
            for weight, leaf in known.casts:
                self.autocast_cache[id(weight)] = (weight, _build(leaf, storages))
            return tree_unflatten([_build(leaf, storages) for leaf in known.leaves], known.spec)


def _signature(mod: Any, args: tuple, kwargs: dict, autocast_cache: dict) -> Any:
    """What decides a pass's allocations, hashable; None when the call cannot be fast-forwarded."""
    try:
        leaves, spec = tree_flatten((args, kwargs))
    except Exception:  # noqa: BLE001 - an argument pytree does not know: just run the call
        return None
    parts: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if not leaf.is_meta or leaf.requires_grad or leaf.layout != torch.strided:
                return None  # host tensors mean real CPU work, whose result the pass may depend on
            parts.append((tuple(leaf.shape), leaf.stride(), leaf.storage_offset(), leaf.dtype))
        elif isinstance(leaf, _SCALARS):
            parts.append((type(leaf), leaf))
        else:
            return None
    return (id(mod), mod.training, str(spec), tuple(parts), torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"), torch.is_inference_mode_enabled(), tuple(sorted(autocast_cache)))


def _describe(leaf: Any, ids: Any, index: dict[int, int]) -> _Leaf | None:
    if isinstance(leaf, torch.Tensor):
        if not leaf.is_meta or leaf.requires_grad or leaf.layout != torch.strided:
            return None
        alloc_id = ids.get(leaf.untyped_storage())
        if alloc_id not in index:
            return None  # an input or a parameter handed back: not the pass's own block
        return _Leaf(index[alloc_id], tuple(leaf.shape), leaf.stride(), int(leaf.storage_offset()), leaf.dtype)
    if isinstance(leaf, _SCALARS):
        return _Leaf(value=leaf)
    return None


def _build(leaf: _Leaf, storages: dict[int, torch.UntypedStorage]) -> Any:
    if leaf.block < 0:
        return leaf.value
    return torch.empty(0, dtype=leaf.dtype, device="meta").set_(storages[leaf.block], leaf.offset, leaf.shape,
                                                                 leaf.stride)
