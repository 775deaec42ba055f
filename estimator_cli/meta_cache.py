"""Reuse meta-kernel results for repeated (op, input metadata): the second and third training steps
run the same ops on the same shapes as the first.

Why: many meta kernels are Python (``torch/_meta_registrations.py``, ``torch/_refs``); measured here they
are most of fake capture's time (ResNet-50 + Adam: ~5k ops per step, ~0.3 ms each). A meta op's output
metadata depends only on its inputs' metadata and its non-tensor arguments, so for ops that create fresh
outputs the cache builds them with ``torch.empty_strided`` semantics on a storage of the same size, and
for pure in-place ops (outputs alias inputs) it returns the aliased inputs. Ops with views or mixed
aliasing, and anything touching a non-meta tensor (real CPU work), always run. FakeTensorMode caches its
dispatch the same way (``torch/_subclasses/fake_tensor.py``, ``_cached_dispatch_impl``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_MISS = object()


class _TensorSpec:
    __slots__ = ("shape", "stride", "offset", "dtype", "nbytes")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()
        self.dtype, self.nbytes = t.dtype, t.untyped_storage().nbytes()

    def build(self) -> torch.Tensor:
        storage = torch.UntypedStorage(self.nbytes, device="meta")
        return torch.empty(0, dtype=self.dtype, device="meta").set_(storage, self.offset, self.shape, self.stride)


def _schema_kind(func: Any) -> tuple[str, list[int]]:
    """("fresh", []) / ("inplace", [arg positions returned]) / ("skip", [])."""
    schema = func._schema
    mutable = {next(iter(a.alias_info.before_set), None): i
               for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
    returns = schema.returns
    if not mutable and all(r.alias_info is None for r in returns):
        if any(a.alias_info is not None for a in schema.arguments):
            return "skip", []
        return "fresh", []
    positions = []
    for r in returns:
        if r.alias_info is None or not r.alias_info.before_set:
            return "skip", []
        pos = mutable.get(next(iter(r.alias_info.before_set)))
        if pos is None:
            return "skip", []
        positions.append(pos)
    return ("inplace", positions) if mutable else ("skip", [])


_SCALARS = (int, float, bool, str, torch.dtype, torch.device, torch.memory_format, torch.layout, type(None))


def _tensor_key(t: torch.Tensor) -> Any:
    if not t.is_meta or t.is_conj() or t.is_neg():
        return None
    return (tuple(t.shape), t.stride(), t.dtype, t.storage_offset())


def _value_key(v: Any, floats: bool = True) -> Any:
    """Hashable description of one argument, or None when the op must run (non-meta tensor, odd type).
    ``floats=False``: a float counts by its type only (see ``MetaCache.call``).

    Hand-rolled rather than ``tree_flatten``: this runs for every op and pytree is the slower part.
    """
    if isinstance(v, torch.Tensor):
        return _tensor_key(v)
    if not floats and type(v) is float:
        return float
    if isinstance(v, _SCALARS):
        return (type(v), v)
    if isinstance(v, (list, tuple)):
        parts = [_value_key(x, floats) for x in v]
        return None if any(p is None for p in parts) else (type(v), tuple(parts))
    return None


def _out_spec(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return _TensorSpec(out) if out.is_meta else None
    if isinstance(out, (list, tuple)):
        parts = [_out_spec(x) for x in out]
        return None if any(p is None and x is not None for p, x in zip(parts, out)) else (type(out), parts)
    return ("value", out)


def _build(spec: Any) -> Any:
    if isinstance(spec, _TensorSpec):
        return spec.build()
    if spec is None:
        return None
    kind, body = spec
    if kind == "value":
        return body
    return kind(_build(x) for x in body)


class MetaCache:
    def __init__(self) -> None:
        self._kinds: dict[Any, tuple[str, list[int]]] = {}
        self._outputs: dict[Any, Any] = {}
        self.hits = 0

    def call(self, func: Any, args: tuple, kwargs: dict, run: Callable[[], Any]) -> Any:
        kind = self._kinds.get(func)
        if kind is None:
            try:
                kind = _schema_kind(func)
            except (AttributeError, StopIteration):
                kind = ("skip", [])
            self._kinds[func] = kind
        if kind[0] == "skip":
            return run()
        # An in-place op's outputs are its inputs, whatever its float operands (Adam's bias-corrected step
        # sizes change every step): those count by type only, so steps 2 and 3 hit the cache. A fresh
        # op's output shape can depend on a float (arange, interpolate's scale factor): exact values.
        floats = kind[0] != "inplace"
        arg_key = _value_key(args, floats)
        kw_key = _value_key(tuple(kwargs.items()), floats) if kwargs else ()
        if arg_key is None or kw_key is None:
            return run()
        key = (func, arg_key, kw_key)
        cached = self._outputs.get(key, _MISS)
        if cached is not _MISS:
            self.hits += 1
            if kind[0] == "inplace":
                picked = [args[i] if i < len(args) else None for i in kind[1]]
                return None if not picked else picked[0] if len(picked) == 1 else tuple(picked)
            return _build(cached)
        out = run()
        if kind[0] == "fresh":
            spec = _out_spec(out)
            if spec is not None:
                self._outputs[key] = spec
        else:
            self._outputs[key] = True
        return out
