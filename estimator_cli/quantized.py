"""bitsandbytes (4-bit and 8-bit weights, 8-bit and paged optimizers) imported as the host it runs on.

Why: ``import bitsandbytes`` registers its CUDA kernels when ``torch.cuda.is_available()`` says so, and
the capture presents a GPU (estimator_cli/cuda_api.py), so an import inside the capture — PEFT imports it
whenever it is installed, transformers when a ``BitsAndBytesConfig`` is given — reaches for CUDA symbols
the CPU wheel lacks (``torch._C._cuda_getCurrentRawStream``) and fails before the script's first line.
Imported with the real answer (no CUDA here), bitsandbytes loads its CPU library and registers, for each
of its operators (``torch.ops.bitsandbytes.quantize_4bit``, ``dequantize_4bit``, ``gemv_4bit``,
``optimizer_update_8bit_blockwise``...), the fake kernel that PyTorch runs on ``meta`` tensors. The
script's GPU tensors are ``meta`` in fake mode, so the packed 4-bit weight, its ``absmax`` and quantization
state, and the 8-bit optimizer state get the shapes and dtypes the CUDA kernels give them, with no
compute. After the import, ``torch.cuda.is_available()`` answers as presented again, so bitsandbytes'
Python side (``Params4bit.cuda()``, transformers' quantizer checks) takes its GPU branch. In profile mode
the same import gives the CPU kernels, which run for real.

Its quantized modules (``Linear4bit``, ``Linear8bitLt``, ``Embedding4bit``, ``Embedding8bit``) convert
their parameters as PyTorch does by default, by assigning ``.data``: the capture makes ``Module.to()``
swap parameters instead (``torch.__future__.set_swap_module_params_on_conversion``), which rebuilds each as
``nn.Parameter(new)``, and ``Params4bit``/``Int8Params`` cannot be rebuilt so (their ``detach()`` returns a
plain tensor), so the HF Trainer's ``model.to(device)`` would fail where on a GPU it does not.

The import is caught by a finder on ``sys.meta_path`` for the capture's duration: a script that never
imports bitsandbytes pays nothing, and one imported earlier (the warm worker's preloads run outside the
capture) is left as it is.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Iterator, Sequence

import torch

PACKAGE = "bitsandbytes"


def _real_is_available() -> bool:
    return bool(torch._C._cuda_getDeviceCount() > 0) if hasattr(torch._C, "_cuda_getDeviceCount") else False


_QUANTIZED_MODULES = ("Linear4bit", "Linear8bitLt", "Embedding4bit", "Embedding8bit")


def _convert_by_data(cls: type) -> None:
    """``cls._apply`` with parameter swapping off, as on a GPU (module docstring); once per class."""
    if "_gpushare_by_data" in vars(cls):
        return
    inherited = getattr(cls, "_apply")

    def _apply(self: Any, fn: Any, recurse: bool = True) -> Any:
        swapping = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(False)
        try:
            return inherited(self, fn, recurse)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swapping)

    setattr(cls, "_apply", _apply)
    setattr(cls, "_gpushare_by_data", True)


def _after_import(package: ModuleType) -> None:
    layers = getattr(package, "nn", None)
    for name in _QUANTIZED_MODULES:
        cls = getattr(layers, name, None)
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            _convert_by_data(cls)


class _HostLoader(importlib.abc.Loader):
    """Runs the package's real loader with ``torch.cuda.is_available`` answering for the real host."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        presented = torch.cuda.is_available
        torch.cuda.is_available = _real_is_available
        try:
            self.inner.exec_module(module)
        finally:
            torch.cuda.is_available = presented
        _after_import(module)


class _HostFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != PACKAGE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _HostLoader(spec.loader)  # type: ignore[arg-type]
        return spec


@contextlib.contextmanager
def host_imported_bitsandbytes() -> Iterator[None]:
    """While active, a first ``import bitsandbytes`` sees the real host's CUDA availability."""
    if PACKAGE in sys.modules:  # imported before the capture, outside the presented GPU
        _after_import(sys.modules[PACKAGE])
        yield
        return
    finder = _HostFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
