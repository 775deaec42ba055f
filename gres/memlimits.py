"""Per-cgroup device memory limits of the NVIDIA driver (r615 / CUDA 13.4 and newer), reached through NVML.

Why ctypes here rather than the binding's wrapper: ``nvmlDeviceSetMemoryLimits_v1`` and
``nvmlDeviceGetMemoryLimits_v1`` exist only in recent nvidia-ml-py releases, and the node extra accepts
older ones. The structs below are NVML's (``nvmlSetMemoryLimits_v1_t``: the cgroup's sysfs path, soft and
hard limit in bytes; ``nvmlGetMemoryLimits_v1_t`` adds the bytes in use), and the function is looked up by
name in the driver's own library, so a driver without it answers ``FUNCTION_NOT_FOUND`` whatever binding
is installed, and the caller says "driver too old" instead of crashing.

Semantics (NVIDIA's documentation of the feature; modelled by ``gpushare.gres.sim_memlimits``): the hard
limit bounds the device memory of every process in the cgroup and its descendants, checked at allocation
(``CUDA_ERROR_OUT_OF_MEMORY`` past it); clearing is soft 0 with hard :data:`LIMIT_MAX`, and removing the
cgroup clears its limits too; MIG handles are not supported; setting needs root, reading does not.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from gpushare.gres.errors import GpuError, NvmlCode

LIMIT_MAX = 0xFFFFFFFFFFFFFFFF  # NVML_DEVICE_MEMORY_LIMIT_MAX: "no hard limit"
SET_FN = "nvmlDeviceSetMemoryLimits_v1"
GET_FN = "nvmlDeviceGetMemoryLimits_v1"


@dataclass(frozen=True)
class MemoryLimit:
    """The limits on one cgroup for one GPU; ``hard`` is None when there is none."""

    cgroup: str
    soft: int
    hard: int | None
    used: int  # device memory charged to the cgroup now


class SetLimits(ctypes.Structure):
    _fields_ = [("nameSpace", ctypes.c_char_p), ("softLimit", ctypes.c_ulonglong), ("hardLimit", ctypes.c_ulonglong)]


class GetLimits(ctypes.Structure):
    _fields_ = [("nameSpace", ctypes.c_char_p), ("softLimit", ctypes.c_ulonglong), ("hardLimit", ctypes.c_ulonglong),
                ("currentUsed", ctypes.c_ulonglong)]


def check_limits(cgroup: str, hard_bytes: int, soft_bytes: int) -> None:
    """Refuse what no backend should pass to the driver: a relative path, limits out of range."""
    if not cgroup.startswith("/") or "\0" in cgroup:
        raise GpuError(NvmlCode.INVALID_ARGUMENT, f"cgroup {cgroup[:80]!r} is not an absolute path")
    if not 0 < hard_bytes <= LIMIT_MAX or not 0 <= soft_bytes <= hard_bytes:
        raise GpuError(NvmlCode.INVALID_ARGUMENT, f"limits soft {soft_bytes} B, hard {hard_bytes} B")


def nvml_call(module: Any, handle: Any, name: str, struct: ctypes.Structure) -> None:
    """Call ``name`` of the driver's NVML library on ``struct``; raises GpuError with NVML's code.

    ``module`` is the initialised binding (``pynvml``); its ``_nvmlGetFunctionPointer`` looks the symbol up
    in the library it loaded (present in every nvidia-ml-py release). A binding without it, or a driver
    library without the symbol, is ``FUNCTION_NOT_FOUND``."""
    lookup = getattr(module, "_nvmlGetFunctionPointer", None)
    if lookup is None:
        raise GpuError(NvmlCode.FUNCTION_NOT_FOUND, f"{name}: this NVML binding cannot look up driver functions")
    try:
        fn = lookup(name)
    except module.NVMLError as exc:
        raise GpuError(NvmlCode.FUNCTION_NOT_FOUND, f"{name} is not in this driver (needs r615 or newer)") from exc
    ret = fn(handle, ctypes.byref(struct))
    if ret:
        raise GpuError(NvmlCode.parse(int(ret)), name)
