"""The ``NA`` value: what a metric the GPU does not support reads as.

Why a value and not an exception (docs/style.md #1, after nvitop's ``NA``): the agent, the exporter and the
simulator read dozens of metrics per GPU per second, and many GPUs lack some of them (no power sensor on a
GeForce card, no per-process memory under some drivers, no energy counter before Volta). If each missing
metric raised, every caller would need a branch; with ``NA`` they compute as usual and get NaN, and a
report prints ``N/A``. Only real faults (a lost GPU, a bad argument) raise :class:`gpushare.gres.errors.GpuError`.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypeVar

T = TypeVar("T")


class _NAType(float):
    """A float NaN that prints as ``N/A`` and survives arithmetic as ``NA``.

    Subclassing float means ``float(NA)``, ``math.isnan(NA)``, ``NA * 2``, ``NA / MiB`` and json-free
    formatting all work without special cases. Arithmetic returns ``NA`` itself so results still print
    as ``N/A``. Comparisons follow NaN (always False), except ``NA == NA`` so tests can compare results.
    """

    _instance: "_NAType | None" = None

    def __new__(cls) -> "_NAType":
        if cls._instance is None:
            cls._instance = super().__new__(cls, math.nan)
        return cls._instance

    def __repr__(self) -> str:
        return "NA"

    def __str__(self) -> str:
        return "N/A"

    def __format__(self, spec: str) -> str:
        # Keep fill, alignment and width so tables stay aligned; drop sign, precision and number type.
        match = re.match(r"^((?:.?[<>^=])?)[+\- ]?z?#?0?(\d*)[,_]?(?:\.\d+)?[a-zA-Z%]?$", spec)
        text_spec = (match.group(1).replace("=", ">") + match.group(2)) if match else ""
        return format("N/A", text_spec)

    def __bool__(self) -> bool:  # "is there a value?" reads naturally: ``if used: ...``
        return False

    def __eq__(self, other: object) -> bool:
        return other is self

    def __ne__(self, other: object) -> bool:
        return other is not self

    def __hash__(self) -> int:
        return hash("gres.NA")

    def __reduce__(self) -> str:  # pickles (multiprocessing) back to the singleton
        return "NA"

    def _na(self, *_: Any) -> "_NAType":
        return self

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _na
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _na
    __pow__ = __rpow__ = __neg__ = __pos__ = __abs__ = _na


NA = _NAType()
"""The singleton. Test with ``value is NA`` or :func:`is_na` (which also accepts plain NaN)."""

NaType = _NAType


def is_na(value: object) -> bool:
    """True for ``NA``, ``None`` and float NaN: "no number here"."""
    if value is NA or value is None:
        return True
    return isinstance(value, float) and math.isnan(value)


def or_default(value: T | _NAType, default: T) -> T:
    """``value`` unless it is NA/None/NaN; for callers that need a plain number (e.g. JSON output)."""
    return default if is_na(value) else value  # type: ignore[return-value]
