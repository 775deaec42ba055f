"""Placeholder values for `.item()` on tensors that have no data, and the error that ends fake capture.

Why: nearly every real training script calls ``loss.item()`` to log the loss, yet in fake mode the GPU
tensors have no values. Returning a made-up number is dangerous (docs/estimator.md: a dummy value silently
built a 3k-parameter RegNet), so the number we return is a *tainted* float/int: it may be printed,
formatted and summed (logging), but the moment it reaches control flow (``if``, comparisons), a shape
(``range``, indexing) or a tensor operation, it raises :class:`DataDependent`, and ``auto`` mode falls
back to real CPU execution with the reason — unless the script's source shows that the use cannot decide
memory (estimator_cli/value_use.py: an index or loop bound that only leads to output, an ``if`` between
host-only branches); then it gets a small concrete value, noted in the report. Host copies of value-free
GPU tensors (``tainted_list``, ``TaintedArray``) follow the same rules. So a placeholder can only ever
affect host work: log lines, files, bookkeeping.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn

from gpushare.errors import GpushareError

PLACEHOLDER_VALUE = 1.0  # positive and finite, so `math.isnan(loss)`-style guards pass as they would


class DataDependent(GpushareError, RuntimeError):
    """The script needs a GPU tensor's *value*; fake capture cannot continue faithfully."""


def _refuse(what: str) -> NoReturn:
    from gpushare.estimator_cli.value_use import where

    at = "" if " at " in what else f" at {where()}"
    raise DataDependent(
        f"the script uses the value of a GPU tensor ({what}{at}); fake mode has no values, "
        "so the estimate needs real execution (--mode profile)"
    )


on_assumed: list[Callable[[str], None]] = []  # the presenter's note of each assumed value (device_mode.py)


def bounded(what: str) -> int:
    """A small concrete int for a value-free read whose every use is a Python index, a loop bound or
    output (estimator_cli/value_use.py); refused, naming the line, when a use may decide memory."""
    from gpushare.estimator_cli.value_use import use_of_read

    use = use_of_read()
    if not use.bounded:
        _refuse(f"{what} at {use.where}, where its value may decide memory")
    for note in on_assumed:
        note(f"{what} at {use.where} used only as {', '.join(sorted(use.uses)) or 'output'} (assumed {use.value})")
    return use.value


def condition(what: str) -> bool:
    """A value-free condition: false when it only chooses between branches of host work (value_use.py;
    true where only the ``if`` branch binds a name read later), else refused, naming the line."""
    from gpushare.estimator_cli.value_use import condition_of_read

    use = condition_of_read()
    if not use.bounded:
        _refuse(what)
    for note in on_assumed:
        note(f"{what} at {use.where} choosing between host-only branches (assumed {str(use.outcome).lower()})")
    return use.outcome


class _Tainted:
    """Mixin: arithmetic keeps the taint, anything that could steer the program refuses."""

    origin: str = ".item()"

    def __bool__(self) -> bool:
        return condition(f"{self.origin} used in a condition")

    def __index__(self) -> int:
        return bounded(f"{self.origin} used as an index or size")

    def __lt__(self, other: Any) -> bool:
        return condition(f"{self.origin} compared")

    __le__ = __gt__ = __ge__ = __lt__

    def __eq__(self, other: Any) -> bool:  # type: ignore[override]
        return condition(f"{self.origin} compared")

    __ne__ = __eq__

    def __hash__(self) -> int:
        _refuse(f"{self.origin} used as a key")

    def __round__(self, ndigits: Any = None) -> Any:
        return self


def _arith(name: str, base: type) -> Any:
    def op(self: Any, *args: Any) -> Any:
        result = getattr(base, name)(self, *args)
        if result is NotImplemented:
            return result
        return TaintedFloat(result) if isinstance(result, float) else TaintedInt(int(result))
    op.__name__ = name
    return op


class TaintedFloat(_Tainted, float):
    """A float placeholder for a value only the GPU would know."""

    def __repr__(self) -> str:
        return float.__repr__(self)


class TaintedInt(_Tainted, int):
    """An int placeholder (integer or boolean tensors' ``.item()``)."""

    def __repr__(self) -> str:
        return int.__repr__(self)


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
              "__rtruediv__", "__pow__", "__rpow__", "__neg__", "__abs__", "__floordiv__", "__rfloordiv__",
              "__mod__", "__rmod__"):
    setattr(TaintedFloat, _name, _arith(_name, float))
    setattr(TaintedInt, _name, _arith(_name, int))
TaintedFloat.__float__ = lambda self: TaintedFloat(float.__float__(self))  # type: ignore[method-assign]


def _int_refused(self: Any) -> int:
    return bounded(f"{self.origin} converted to int")


TaintedFloat.__int__ = _int_refused  # type: ignore[method-assign]
TaintedFloat.__trunc__ = _int_refused  # type: ignore[method-assign]


def placeholder(dtype_is_floating: bool) -> float | int:
    """The value `.item()` returns for a fake GPU tensor.

    Always a float, even for integer tensors: CPython takes an ``int`` subclass as a size or index
    without asking it (``range(n)``, ``seq[n]``), so an int placeholder could silently steer the
    program; a float there raises ``TypeError`` instead, and ``auto`` falls back. Counting
    (``correct += (pred == y).sum().item()``) and formatting still work.
    """
    return TaintedFloat(PLACEHOLDER_VALUE)


def is_tainted(value: Any) -> bool:
    return isinstance(value, _Tainted)


def refuse(what: str) -> NoReturn:
    """Raise :class:`DataDependent` for `what` (public for the presenter)."""
    _refuse(what)


def tainted_list(shape: tuple[int, ...]) -> Any:
    """``.tolist()`` of a tensor without values: nested lists of placeholders of its shape."""
    if not shape:
        return TaintedFloat(PLACEHOLDER_VALUE)
    return [tainted_list(shape[1:]) for _ in range(shape[0])]


def tainted_array(values: Any) -> Any:
    """``.numpy()`` of a tensor without values (its host copy holds placeholders): an array that can be
    computed with, saved as an image and formatted, but refuses a condition, an index or a size; its
    scalars (``arr.mean()``, ``arr.item()``) are placeholders."""
    return values.view(TaintedArray)


try:
    import numpy as _np
except ImportError:  # numpy ships with every torch wheel we support; without it there is nothing to taint
    _np = None  # type: ignore[assignment]

if _np is not None:
    class TaintedArray(_np.ndarray):
        """A host array computed from GPU values fake mode does not have (see :func:`tainted_array`)."""

        def __array_wrap__(self, array: Any, context: Any = None, return_scalar: bool = False) -> Any:
            if return_scalar or array.ndim == 0:
                return TaintedFloat(PLACEHOLDER_VALUE)
            return array.view(TaintedArray)

        def __bool__(self) -> bool:
            return condition("a condition on an array computed from GPU values")

        def __index__(self) -> int:
            return bounded("an array computed from GPU values used as an index or size")

        def __int__(self) -> int:
            return bounded("an array computed from GPU values converted to int")

        def __float__(self) -> float:
            return TaintedFloat(PLACEHOLDER_VALUE)

        def item(self, *args: Any) -> Any:
            return TaintedFloat(PLACEHOLDER_VALUE)

        def tolist(self) -> Any:
            return tainted_list(self.shape)
