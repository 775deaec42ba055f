"""Keep ``torch._dynamo`` unimported while capturing, unless the script really uses it.

Why: every ``optimizer.step()`` and ``zero_grad()`` goes through ``torch._dynamo.graph_break()`` /
``torch._dynamo.disable(fn)`` (``torch/optim/optimizer.py``, ``torch/_compile.py``), which imports
dynamo: measured here, 2.8–5 s, more than the whole capture. Outside ``torch.compile`` both calls are
no-ops, so a stand-in answers them; any other attribute (``torch.compile``, ``is_compiling``,
``config``...) imports the real module, swaps it in and forwards, so compiled scripts are unaffected.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from typing import Any, Callable, Iterator

import torch

_NAME = "torch._dynamo"


class _LazyDynamo(types.ModuleType):
    """Answers ``graph_break`` and ``disable`` without importing dynamo; loads it for anything else."""

    def __init__(self) -> None:
        super().__init__(_NAME)
        self._real: types.ModuleType | None = None

    @staticmethod
    def graph_break(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def disable(fn: Callable[..., Any] | None = None, recursive: bool = True, **kwargs: Any) -> Any:
        return fn if fn is not None else (lambda f: f)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name != "__path__":  # __path__: a submodule import needs the real one
            raise AttributeError(name)
        return getattr(self.load(), name)

    def load(self) -> types.ModuleType:
        if self._real is None:
            if sys.modules.get(_NAME) is self:
                del sys.modules[_NAME]
            self._real = importlib.import_module(_NAME)
            torch._dynamo = self._real  # type: ignore[attr-defined]
        return self._real


@contextlib.contextmanager
def lazy_dynamo() -> Iterator[None]:
    if _NAME in sys.modules:  # already imported (by the script's imports): nothing to save
        yield
        return
    stub = _LazyDynamo()
    sys.modules[_NAME] = stub
    torch._dynamo = stub  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if sys.modules.get(_NAME) is stub:
            del sys.modules[_NAME]
            with contextlib.suppress(AttributeError):
                delattr(torch, "_dynamo")
