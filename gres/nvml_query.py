"""The one choke point for NVML calls (docs/style.md #2, after nvitop's ``libnvml``).

Why one place: NVML needs ``nvmlInit`` before and ``nvmlShutdown`` after use; drivers and bindings differ
in which versioned functions exist (``…_v3``/``_v2``/plain); and "this GPU cannot report that" must read as
``NA`` everywhere while real faults raise ``GpuError`` with NVML's code. Doing that per call site is how
agents end up crashing on a GeForce card without a power sensor.

``Nvml(module)`` takes the binding module (``pynvml`` by default), so tests can hand it a fake one. Importing
this module never touches the driver; the first :meth:`Nvml.query` does, and a missing library or driver
becomes ``GpuError(DRIVER_NOT_LOADED / LIBRARY_NOT_FOUND, "NVML not available: <reason>")``.
"""

from __future__ import annotations

import atexit
import logging
import re
import threading
from types import ModuleType
from typing import Any, Callable

from gpushare.gres.errors import GpuError, NvmlCode
from gpushare.gres.na import NA

log = logging.getLogger(__name__)

RAISE: Any = object()
"""Pass as ``default`` to make NOT_SUPPORTED and missing functions raise too (for operations, not metrics)."""

_VERSIONED = re.compile(r"^(.*)_v(\d+)$")


def _load_pynvml() -> ModuleType:
    try:
        import pynvml  # nvidia-ml-py; the "node" extra
    except ImportError as exc:
        raise GpuError(NvmlCode.LIBRARY_NOT_FOUND,
                       f"NVML not available: {exc} (install with: pip install 'slurm-gpushare[node]')") from exc
    return pynvml


class Nvml:
    """Lazy-initialised NVML session; thread-safe; every call goes through :meth:`query`."""

    def __init__(self, module: ModuleType | None = None) -> None:
        self._module = module
        self._lock = threading.Lock()
        self._initialised = False
        self._missing_logged: set[str] = set()

    @property
    def lib(self) -> ModuleType:
        """The binding module, initialised (raises a clear GpuError when NVML cannot start)."""
        with self._lock:
            if self._module is None:
                self._module = _load_pynvml()
            if not self._initialised:
                try:
                    self._module.nvmlInit()
                except self._module.NVMLError as exc:
                    code = NvmlCode.parse(getattr(exc, "value", 999))
                    raise GpuError(code, f"NVML not available: {exc}") from exc
                except OSError as exc:  # libnvml.so missing on a CPU-only host, depending on binding
                    raise GpuError(NvmlCode.LIBRARY_NOT_FOUND, f"NVML not available: {exc}") from exc
                self._initialised = True
                atexit.register(self.shutdown)
            return self._module

    def shutdown(self) -> None:
        with self._lock:
            if self._initialised and self._module is not None:
                try:
                    self._module.nvmlShutdown()
                except Exception:  # at exit there is nobody left to tell
                    pass
                self._initialised = False

    def _log_missing(self, name: str) -> None:
        if name not in self._missing_logged:
            self._missing_logged.add(name)
            log.warning("NVML function %s is not available with this driver/binding; reading N/A", name)

    def _candidates(self, func: str | Callable[..., Any]) -> list[tuple[str, Callable[..., Any] | None]]:
        if callable(func):
            return [(getattr(func, "__name__", repr(func)), func)]
        names = [func]
        match = _VERSIONED.match(func)
        if match:  # nvmlFoo_v3 → nvmlFoo_v2 → nvmlFoo
            base, version = match.group(1), int(match.group(2))
            names += [f"{base}_v{v}" for v in range(version - 1, 1, -1)] + [base]
        lib = self.lib
        return [(name, getattr(lib, name, None)) for name in names]

    def query(self, func: str | Callable[..., Any], *args: Any, default: Any = NA) -> Any:
        """Call an NVML function by name (or callable) with ``args``.

        Returns ``default`` (``NA`` unless told otherwise) when the GPU does not support it or the
        function does not exist in this driver/binding (logged once per function); raises ``GpuError``
        with NVML's code for anything else, or for everything when ``default is RAISE``.
        """
        lib = self.lib
        last_name = str(func)
        for name, fn in self._candidates(func):
            last_name = name
            if fn is None:
                continue
            try:
                return fn(*args)
            except lib.NVMLError as exc:
                code = NvmlCode.parse(getattr(exc, "value", 999))
                if code is NvmlCode.FUNCTION_NOT_FOUND:
                    continue  # try the older version
                if code is NvmlCode.NOT_SUPPORTED and default is not RAISE:
                    return default
                raise GpuError(code, f"{name}") from exc
        self._log_missing(last_name)
        if default is RAISE:
            raise GpuError(NvmlCode.FUNCTION_NOT_FOUND, f"{last_name} is not available in this driver/binding")
        return default
