"""The simulated GPUs' per-cgroup memory limits, with the semantics NVIDIA documents for r615+ drivers.

Why modelled at all: the Prolog's driver backend (``gpushare.node.hardcap``) and what a job sees under it
are tested without such a driver, so the model must fail where the driver fails and report what it
reports. Each GPU of a scenario says what its driver offers (``memory_limits``):

- ``absent``: a driver before r615; the NVML functions do not exist (``FUNCTION_NOT_FOUND``);
- ``off``: r615+ with memory accounting off (kernel before 6.14 without the driver's own accounting, or
  ``RmMemacctMode=0``): ``NOT_SUPPORTED``;
- ``dmem``: the kernel's dmem controller (6.14+): a limit can be set only on a cgroup that has ``dmem.max``
  (its parent enables ``+dmem``); limits nest, every limited ancestor bounds a process;
- ``misc``: the driver's own accounting (older kernels): limits do not nest (only the nearest limited
  cgroup bounds a process) and a hard limit below current use is refused.

What is modelled (NVIDIA's documentation): an allocation past a bounding hard limit is
``CUDA_ERROR_OUT_OF_MEMORY``; managed memory is not charged to the cgroup (the memory controller tracks it
only in system memory), though it occupies the device; ``cuMemGetInfo`` free is capped by the headroom of
every bounding limit, and total shows the hard limit only for a limit on the process's own (leaf) cgroup:
a limit on a parent is enforced while total shows the whole GPU. MIG is not supported; clearing is soft 0
with hard ``LIMIT_MAX``. Not modelled: soft-limit eviction (it needs MPS), the privilege check on setting.
"""

from __future__ import annotations

import os
from typing import Any

from gpushare.gpus import MiB
from gpushare.gres import sim_timeline as tl
from gpushare.gres.errors import GpuError, NvmlCode
from gpushare.gres.memlimits import LIMIT_MAX, MemoryLimit, check_limits

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


def _inside(cgroup: str, ancestor: str) -> bool:
    return cgroup == ancestor or cgroup.startswith(ancestor.rstrip("/") + "/")


def require(g: dict[str, Any], what: str) -> None:
    """Raise what the driver of GPU ``g`` answers when asked for per-cgroup limits and cannot give them."""
    mode = g.get("memory_limits", "absent")
    if mode == "absent":
        raise GpuError(NvmlCode.FUNCTION_NOT_FOUND, f"{what}: nvmlDeviceSetMemoryLimits_v1 is not in this driver")
    if mode == "off":
        raise GpuError(NvmlCode.NOT_SUPPORTED, f"{what}: device memory accounting is off on GPU {g['index']}")
    if g.get("mig_current"):
        raise GpuError(NvmlCode.NOT_SUPPORTED, f"{what}: GPU {g['index']} is in MIG mode")


def usage(g: dict[str, Any], processes: list[dict[str, Any]], t: float, cgroup: str) -> int:
    """Bytes charged to ``cgroup`` and its descendants on GPU ``g``: device allocations, managed memory not."""
    return sum(int((tl.values_at(p, t)["memory_mib"] - p.get("managed_mib", 0.0)) * MiB)
               for p in tl.running(processes, g["index"], t) if p.get("cgroup") and _inside(p["cgroup"], cgroup))


def bounding(g: dict[str, Any], cgroup: str | None) -> list[tuple[str, int]]:
    """The (cgroup, hard limit) pairs that bound a process in ``cgroup``, nearest first."""
    if not cgroup:
        return []
    limits = sorted(((c, h) for c, h in g.get("cgroup_limits", {}).items() if _inside(cgroup, c)),
                    key=lambda ch: -len(ch[0]))
    return limits[:1] if g.get("memory_limits") == "misc" else limits


def set_limit(g: dict[str, Any], processes: list[dict[str, Any]], t: float, cgroup: str, hard: int, soft: int) -> None:
    require(g, "set memory limits")
    check_limits(cgroup, hard, soft)
    if not os.path.isdir(cgroup):
        raise GpuError(NvmlCode.NOT_FOUND, f"no cgroup {cgroup}")
    limits = g.setdefault("cgroup_limits", {})
    if hard == LIMIT_MAX and soft == 0:
        limits.pop(cgroup, None)
        return
    if g["memory_limits"] == "dmem" and not os.path.exists(os.path.join(cgroup, "dmem.max")):
        raise GpuError(NvmlCode.NOT_SUPPORTED, f"{cgroup} has no dmem.max (its parent does not enable +dmem)")
    if g["memory_limits"] == "misc" and hard < usage(g, processes, t, cgroup):
        raise GpuError(NvmlCode.INVALID_ARGUMENT, f"hard limit {hard} B is below what {cgroup} uses")
    limits[cgroup] = hard


def get_limit(g: dict[str, Any], processes: list[dict[str, Any]], t: float, cgroup: str) -> MemoryLimit:
    require(g, "get memory limits")
    hard = g.get("cgroup_limits", {}).get(cgroup)
    return MemoryLimit(cgroup, 0, hard, usage(g, processes, t, cgroup))


def allocate(g: dict[str, Any], processes: list[dict[str, Any]], t: float, cgroup: str | None, nbytes: int,
             managed: bool) -> int:
    """The CUDA result of allocating ``nbytes`` now from a process in ``cgroup`` (no state change)."""
    used = sum(int(tl.values_at(p, t)["memory_mib"] * MiB) for p in tl.running(processes, g["index"], t))
    if managed:
        return CUDA_SUCCESS  # migrates, can be evicted: never refused on the device's or a cgroup's account
    if used + nbytes > g["total_bytes"]:
        return CUDA_ERROR_OUT_OF_MEMORY
    for limited, hard in bounding(g, cgroup):
        if usage(g, processes, t, limited) + nbytes > hard:
            return CUDA_ERROR_OUT_OF_MEMORY
    return CUDA_SUCCESS


def mem_get_info(g: dict[str, Any], processes: list[dict[str, Any]], t: float, cgroup: str | None) -> tuple[int, int]:
    """(free, total) as ``cuMemGetInfo`` reports them to a process in ``cgroup``."""
    used = sum(int(tl.values_at(p, t)["memory_mib"] * MiB) for p in tl.running(processes, g["index"], t))
    free, total = max(0, g["total_bytes"] - used), g["total_bytes"]
    for limited, hard in bounding(g, cgroup):
        free = min(free, max(0, hard - usage(g, processes, t, limited)))
        if limited == cgroup:
            total = min(total, hard)
    return free, total
