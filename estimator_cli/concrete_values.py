"""Real values for small GPU tensors in fake mode: a CPU "shadow" beside each small meta tensor.

Why: fake-mode GPU tensors live on ``meta`` and have no data, yet real scripts read a few GPU values to
steer the program — Hugging Face transformers asks ``padding_mask.all()`` in its attention-mask code,
scripts call ``int(lengths.max())``, ``labels.cpu()``, ``if mask.any()``. Those values almost always come
from *concrete inputs* (a batch's mask or labels moved to the GPU, ``torch.arange(device='cuda')``,
buffers like rotary frequencies) and from cheap operations on them, never from the large activations.

So the presenter (estimator_cli/device_mode.py) keeps, for every meta tensor that is small (at most
``MAX_ELEMENTS`` elements), does not require grad, and whose meta inputs all have shadows, a CPU tensor
computed by the same call on the shadows. A value read then answers from the shadow: conditions,
``int()``, ``.item()``, ``.tolist()``, ``.cpu()`` and data-dependent shapes (``nonzero``, boolean-mask
indexing) are exact. Large tensors, and anything computed from them (the loss, logits, parameters after
an optimizer step), stay value-free; reading those still gives a placeholder or stops fake mode
(estimator_cli/placeholders.py).

Consistency: views are computed as views of the shadow, so an in-place change through a view reaches
the shadow of its base as it reaches the base; an in-place op with a value-free input drops the shadow
of the tensor it writes (its value is no longer known).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

MAX_HOST_PLACEHOLDER = 1 << 24  # host copies of value-free tensors up to 16M elements are real tensors
# masks, index maps, box-assignment tables, and the batches they come from: a vision-language model drops its
# padding image tiles by a mask computed from the pixel values themselves (Idefics3/SmolVLM: 13 tiles of
# 3 x 384 x 384, 5.8M elements); 16M float32 elements are 64 MB and about 10 ms per elementwise op on a CPU
MAX_ELEMENTS = 1 << 24

_NO_SHADOW = object()


def _small(t: torch.Tensor) -> bool:
    """A tensor worth a value: not too large, no autograd, strided, and not a lazy module's tensor that has no
    shape yet (asking an ``UninitializedParameter`` its size raises)."""
    return not torch.nn.parameter.is_lazy(t) and t.numel() <= MAX_ELEMENTS and not t.requires_grad \
        and t.layout == torch.strided


class ConcreteValues:
    """Shadow store: meta tensor -> CPU tensor holding its real value, plus the counts for the report."""

    def __init__(self) -> None:
        self.shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.concrete_reads: dict[str, int] = {}  # what was read, with a real value
        self.placeholder_reads: dict[str, int] = {}  # what was read without one
        self.shadowed = 0  # tensors that got a value
        self.tainted_host: WeakIdKeyDictionary = WeakIdKeyDictionary()  # host tensors holding placeholders

    # -- store --------------------------------------------------------------------------------------
    def get(self, t: Any) -> torch.Tensor | None:
        if isinstance(t, torch.Tensor) and t.is_meta:
            return self._shadow_of(t)
        return None

    def _shadow_of(self, meta: torch.Tensor) -> torch.Tensor | None:
        """The value of ``meta``, made now when it was deferred (:class:`_Deferred`)."""
        shadow = self.shadows.get(meta)
        if isinstance(shadow, _Deferred):
            del self.shadows[meta]
            self.shadowed -= 1
            value = shadow.make()
            if value is not None:
                self.attach(meta, value)
            return self.shadows.get(meta)
        return shadow

    def attach(self, meta: torch.Tensor, value: torch.Tensor) -> None:
        if meta.is_meta and _small(meta) and tuple(value.shape) == tuple(meta.shape) and value.dtype == meta.dtype:
            self.shadows[meta] = value
            self.shadowed += 1

    def attach_copy(self, meta: Any, source: Any) -> None:
        """``source`` (host tensor) was moved to the GPU as ``meta``: its value is known."""
        if isinstance(meta, torch.Tensor) and isinstance(source, torch.Tensor) and not source.is_meta \
                and _small(meta) and not isinstance(source, torch.nn.Parameter) and source not in self.tainted_host:
            with _disable_current_modes():
                self.attach(meta, source.detach().to(dtype=meta.dtype, copy=True))

    @contextlib.contextmanager
    def swapping(self, t1: Any, t2: Any) -> Iterator[None]:
        """``torch.utils.swap_tensors(t1, t2)`` inside: it refuses a tensor with a weak reference, which the
        store keeps on each tensor it knows a value of (``load_state_dict`` swaps a model's buffers in while
        parameters are swapped). The entries are taken out for the swap and follow the contents: afterwards
        ``t1`` holds what ``t2`` held, value included."""
        held = [(table, table.pop(t1, None), table.pop(t2, None)) for table in (self.shadows, self.tainted_host)]
        swapped = False
        try:
            yield
            swapped = True
        finally:
            for table, v1, v2 in held:
                first, second = (v2, v1) if swapped else (v1, v2)
                if first is not None:
                    table[t1] = first
                if second is not None:
                    table[t2] = second

    def note(self, what: str, concrete: bool) -> None:
        table = self.concrete_reads if concrete else self.placeholder_reads
        table[what] = table.get(what, 0) + 1

    # -- placeholders that reached host tensors ------------------------------------------------------
    def host_taint_involved(self, args: tuple, kwargs: dict) -> bool:
        from gpushare.estimator_cli.placeholders import is_tainted

        for v in (*args, *kwargs.values()):
            if is_tainted(v) or (isinstance(v, torch.Tensor) and not v.is_meta and v in self.tainted_host):
                return True
            if isinstance(v, (list, tuple)) and any(is_tainted(x) for x in v):
                return True
        return False

    def untaint_args(self, args: tuple) -> tuple:
        from gpushare.estimator_cli.placeholders import PLACEHOLDER_VALUE, is_tainted

        def plain(v: Any) -> Any:
            if is_tainted(v):
                return PLACEHOLDER_VALUE
            if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
                return type(v)(plain(x) for x in v)
            return v
        return tuple(plain(a) for a in args)

    def untaint_kwargs(self, kwargs: dict) -> dict:
        return dict(zip(kwargs, self.untaint_args(tuple(kwargs.values()))))

    def placeholder_host(self, meta: torch.Tensor) -> torch.Tensor:
        """A host copy of a value-free GPU tensor: its shape and dtype, placeholder values, tainted. Past
        ``MAX_HOST_PLACEHOLDER`` elements one value is broadcast (no host memory for a copy of logits)."""
        from gpushare.estimator_cli.placeholders import PLACEHOLDER_VALUE

        with _disable_current_modes(), torch._C.DisableTorchFunction():
            if meta.numel() <= MAX_HOST_PLACEHOLDER:
                host = torch.full(tuple(meta.shape), PLACEHOLDER_VALUE, dtype=meta.dtype)
            else:
                host = torch.full((), PLACEHOLDER_VALUE, dtype=meta.dtype).expand(tuple(meta.shape))
        self.tainted_host[host] = True
        return host

    def taint_host(self, out: Any, written: Any) -> None:
        for t in (*_leaves(out), written):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.tainted_host[t] = True

    # -- propagation -----------------------------------------------------------------------------
    def _swap(self, value: Any) -> Any:
        """Meta tensors -> their shadows; _NO_SHADOW when one has none; device requests -> cpu."""
        if isinstance(value, torch.Tensor):
            if not value.is_meta:
                return value
            shadow = self._shadow_of(value)
            return _NO_SHADOW if shadow is None else shadow
        if isinstance(value, torch.device) and value.type == "meta":
            return torch.device("cpu")
        if isinstance(value, (list, tuple)):
            out = [self._swap(v) for v in value]
            if any(v is _NO_SHADOW for v in out):
                return _NO_SHADOW
            return type(value)(out) if not hasattr(value, "_fields") else type(value)(*out)
        return value

    def swapped(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The call's arguments with shadows in place of meta tensors, or None when one is value-free."""
        new_args = self._swap(args)
        if new_args is _NO_SHADOW:
            return None
        new_kwargs = {}
        for k, v in kwargs.items():
            s = self._swap(v)
            if s is _NO_SHADOW:
                return None
            new_kwargs[k] = s
        return new_args, new_kwargs

    def propagate(self, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> None:
        """After a meta call: give its small outputs the value the same call computes on the shadows."""
        metas = [t for t in _leaves(out) if isinstance(t, torch.Tensor) and t.is_meta]
        written = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].is_meta \
            and _is_inplace(func) else None
        if written is None and (not metas or not all(_small(t) for t in metas)):
            return  # an in-place write goes on even with no output: ``x[i] = v`` returns None, yet writes x
        call = self.swapped(args, kwargs)
        if call is None:
            if written is not None:
                self.shadows.pop(written, None)
            elif func in _HEALTH_CHECKS and isinstance(out, torch.Tensor) and _small(out):
                self._assume_healthy(func, out)
            return
        takes_tensors = any(isinstance(t, torch.Tensor) for t in (*_leaves(call[0]), *_leaves(call[1].values())))
        if not takes_tensors and not _is_factory(func):
            return
        if not takes_tensors and getattr(func, "__name__", "") in _DEFERRABLE and "out" not in kwargs \
                and isinstance(out, torch.Tensor) and out.is_meta:
            self.shadows[out] = _Deferred(func, call[0], call[1])
            self.shadowed += 1
            return
        value = _on_cpu(func, call[0], call[1])
        if value is _FAILED:
            if written is not None:
                self.shadows.pop(written, None)
            return
        for meta, real in zip(_leaves(out), _leaves(value)):
            if isinstance(meta, torch.Tensor) and meta.is_meta and isinstance(real, torch.Tensor) \
                    and meta is not written:
                self.attach(meta, real)


    def _assume_healthy(self, func: Callable[..., Any], out: torch.Tensor) -> None:
        """``isnan``/``isinf``/``isfinite`` of a value-free tensor (the loss guard of Hugging Face's Trainer and
        many loops): answered as a normal step would have it, finite — the same assumption GradScaler's
        overflow check gets (estimator_cli/cuda_api.py)."""
        finite = _HEALTH_CHECKS[func]
        with _disable_current_modes():
            self.attach(out, torch.full(tuple(out.shape), finite, dtype=torch.bool))
        self.note(f"{func.__name__} of a value-free tensor (assumed finite)", concrete=False)


_HEALTH_CHECKS = {torch.isnan: False, torch.Tensor.isnan: False, torch.isinf: False, torch.Tensor.isinf: False,
                  torch.isfinite: True, torch.Tensor.isfinite: True, torch.isposinf: False, torch.isneginf: False}


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [y for x in value for y in _leaves(x)]
    return [value]


def _is_inplace(func: Callable[..., Any]) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in {"__setitem__", "__iadd__", "__isub__",
                                                                         "__imul__", "__itruediv__",
                                                                         "__ior__", "__iand__", "copy_"}


_FACTORIES = frozenset({"arange", "zeros", "ones", "full", "empty", "tensor", "as_tensor", "linspace",
                        "eye", "zeros_like", "ones_like", "full_like", "empty_like", "tril", "triu",
                        "range", "scalar_tensor", "randperm", "rand", "randn", "randint"})


# Factories whose value depends on their plain arguments alone: their CPU value is made when first read, not
# at the call. Most are never read (PEFT's DoRA builds an identity matrix per adapter per forward, only to
# multiply it with a weight, whose product has no value anyway: made eagerly, those took a quarter of a
# DoRA capture). Random factories stay eager (they draw from the generator when the script calls them), as do
# tensor/as_tensor (their Python data may change after the call).
_DEFERRABLE = frozenset({"arange", "zeros", "ones", "full", "empty", "linspace", "eye", "range", "scalar_tensor"})


_FAILED = object()


def _on_cpu(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``func`` on the shadows, outside the capture's modes; _FAILED when the CPU kernel disagrees (dtype
    support, a CUDA-only op): the outputs then stay value-free."""
    try:
        with _disable_current_modes(), torch.no_grad():
            return func(*args, **kwargs)
    except Exception:
        return _FAILED


class _Deferred:
    """A factory call on plain arguments, kept to be made on the CPU when its value is first read."""

    __slots__ = ("func", "args", "kwargs")

    def __init__(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs

    def make(self) -> torch.Tensor | None:
        value = _on_cpu(self.func, self.args, self.kwargs)
        return value if isinstance(value, torch.Tensor) else None


def _is_factory(func: Callable[..., Any]) -> bool:
    return getattr(func, "__name__", "") in _FACTORIES


def _integer_index(values: ConcreteValues, index: Any) -> Any:
    """``index`` with each boolean GPU mask replaced by the integer indices of its true entries (from its
    shadow), or None when a mask has no value. Integer advanced indexing has a value-independent shape, so
    the meta kernel (and autograd through it) then works."""
    parts = index if isinstance(index, tuple) else (index,)
    out: list[Any] = []
    changed = False
    for part in parts:
        if isinstance(part, torch.Tensor) and part.is_meta and part.dtype in (torch.bool, torch.uint8):
            shadow = values.get(part)
            if shadow is None:
                return None
            with _disable_current_modes():
                positions = shadow.bool().nonzero(as_tuple=True)
            for real in positions:
                meta = torch.empty(real.shape, dtype=real.dtype, device="meta")
                values.attach(meta, real)
                out.append(meta)
            changed = True
        else:
            out.append(part)
    if not changed:
        return None
    return tuple(out)


_MASK_WRITES = (torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put, torch.index_put)


def masks_as_indices(values: ConcreteValues, func: Callable[..., Any], args: tuple) -> tuple:
    """``x[mask] = v`` / ``index_put_`` with a boolean mask whose value the capture has: the same write
    through the integer indices of the mask's true entries. On meta the write itself succeeds with the mask,
    but autograd saves it, and the backward's ``grad[mask]`` needs ``nonzero``, which meta cannot answer
    (a vision-language model splicing image features into the text embeddings:
    ``inputs_embeds[input_ids == image_token_id] = image_features``)."""
    if func not in _MASK_WRITES or len(args) < 3:
        return args
    index = _integer_index(values, args[1])
    if index is None:
        return args
    values.note("a boolean mask used as an index", concrete=True)
    return (args[0], list(index) if func is not torch.Tensor.__setitem__ else index, *args[2:])


def data_dependent_call(values: ConcreteValues, func: Callable[..., Any], args: tuple, kwargs: dict,
                        exc: BaseException) -> Any:
    """A meta kernel that failed because its output shape depends on values (``nonzero``, ``unique``,
    boolean-mask indexing). With the values at hand the call is completed; otherwise ``exc`` stands and,
    when it is a data-dependence, becomes the placeholder refusal."""
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
                torch.Tensor.index_put, torch.index_put) and len(args) >= 2:
        index = _integer_index(values, args[1])
        if index is not None:
            values.note("a boolean mask used as an index", concrete=True)
            if func in (torch.Tensor.index_put_, torch.Tensor.index_put, torch.index_put):
                index = list(index)
            return func(args[0], index, *args[2:], **kwargs)
    call = values.swapped(args, kwargs)
    if call is None or any(isinstance(t, torch.Tensor) and t.requires_grad for t in _leaves(args)):
        _refuse_if_data_dependent(func, exc)
        raise exc
    with _disable_current_modes(), torch.no_grad():
        value = func(*call[0], **call[1])
    values.note(f"{getattr(func, '__name__', 'an op')} (output shape from values)", concrete=True)

    def to_meta(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            meta = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
            values.attach(meta, v)
            return meta
        if isinstance(v, (list, tuple)):
            items = [to_meta(x) for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
        return v

    return to_meta(value)


def _refuse_if_data_dependent(func: Callable[..., Any], exc: BaseException) -> None:
    text = str(exc)
    if any(s in text for s in ("data-dependent", "data-independent", "with Meta tensors")):
        from gpushare.estimator_cli.placeholders import refuse

        first = text.split(". ")[0].split("\n")[0]
        refuse(f"{getattr(func, '__name__', 'an op')} needs values for its output shape: {first}")
