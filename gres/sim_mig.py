"""MIG semantics of the simulated backend, as pure functions on one GPU's state dict.

Why separate: these rules are what the MIG executor is tested against, so they must match the driver's
behaviour (docs/mig-profiles.md "Behaviour worth knowing") and be readable on their own:
- instances need MIG mode *currently* enabled, else NOT_SUPPORTED;
- a GPU instance is created at an explicit placement; an unknown profile or a start that is not one of
  the profile's legal placements is INVALID_ARGUMENT; overlapping memory slices, too many of a profile or
  too many compute slices is INSUFFICIENT_RESOURCES;
- one compute instance spans its whole GPU instance; a second is INSUFFICIENT_RESOURCES;
- destroying a GI that still has compute instances is IN_USE; destroying a CI with a process on it too;
- GI ids: 0 for the full-GPU profile, else the lowest free id from 1 (the real driver derives the id
  from the placement; code must read ids back, never assume them).
"""

from __future__ import annotations

from typing import Any

from gpushare.gpus import GpuModel, MigProfile
from gpushare.gres.errors import GpuError, NvmlCode

# compute slices -> NVML_COMPUTE_INSTANCE_PROFILE_* index (nvml.h)
CI_PROFILE_BY_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}
MAX_GI_ID = 14


def require_mig(gpu: dict[str, Any], what: str) -> None:
    if not gpu["mig_capable"] or not gpu["mig_current"]:
        raise GpuError(NvmlCode.NOT_SUPPORTED, f"{what}: GPU {gpu['index']} does not have MIG mode enabled")


def profile_by_id(model: GpuModel, profile_id: int) -> MigProfile:
    for profile in model.mig_profiles:
        if profile.gi_profile_id == profile_id:
            return profile
    known = ", ".join(f"{p.gi_profile_id} ({p.name})" for p in model.mig_profiles)
    raise GpuError(NvmlCode.INVALID_ARGUMENT, f"{model.name} has no GPU-instance profile id {profile_id}; known: {known}")


def _slices(gi: dict[str, Any]) -> set[int]:
    return set(range(gi["start"], gi["start"] + gi["size"]))


def create_gi(gpu: dict[str, Any], model: GpuModel, profile_id: int, start: int) -> dict[str, Any]:
    """Add a GPU instance to ``gpu`` (mutates it) and return the new GI record."""
    what = f"create GPU instance profile {profile_id} at {start} on GPU {gpu['index']}"
    require_mig(gpu, what)
    profile = profile_by_id(model, profile_id)
    if start not in profile.placements:
        raise GpuError(NvmlCode.INVALID_ARGUMENT,
                       f"{what}: {profile.name} may start only at {list(profile.placements)}")
    existing = gpu["gpu_instances"]
    wanted = set(range(start, start + profile.memory_slices))
    for gi in existing:
        if _slices(gi) & wanted:
            raise GpuError(NvmlCode.INSUFFICIENT_RESOURCES,
                           f"{what}: memory slices overlap GI {gi['id']} ({gi['profile_name']} at {gi['start']})")
    if sum(1 for gi in existing if gi["profile_id"] == profile_id) >= profile.max_count:
        raise GpuError(NvmlCode.INSUFFICIENT_RESOURCES, f"{what}: at most {profile.max_count} {profile.name}")
    max_compute = max(p.compute_slices for p in model.mig_profiles)
    used_compute = sum(gi["compute_slices"] for gi in existing)
    if used_compute + profile.compute_slices > max_compute:
        raise GpuError(NvmlCode.INSUFFICIENT_RESOURCES,
                       f"{what}: {used_compute} of {max_compute} compute slices already used")
    taken = {gi["id"] for gi in existing}
    if profile.memory_slices == model.memory_slices:
        gi_id = 0
    else:
        gi_id = next(i for i in range(1, MAX_GI_ID + 1) if i not in taken)
    record = {"id": gi_id, "profile_id": profile_id, "profile_name": profile.name, "start": start,
              "size": profile.memory_slices, "compute_slices": profile.compute_slices,
              "memory_bytes": profile.usable_bytes, "cis": []}
    existing.append(record)
    existing.sort(key=lambda gi: gi["id"])
    return record


def find_gi(gpu: dict[str, Any], gi_id: int) -> dict[str, Any]:
    for gi in gpu["gpu_instances"]:
        if gi["id"] == gi_id:
            return gi
    raise GpuError(NvmlCode.NOT_FOUND, f"GPU {gpu['index']} has no GPU instance {gi_id}")


def create_ci(gpu: dict[str, Any], gi_id: int) -> tuple[dict[str, Any], int]:
    """Add the whole-GI compute instance; returns (gi record, ci id)."""
    require_mig(gpu, f"create compute instance in GI {gi_id}")
    gi = find_gi(gpu, gi_id)
    if gi["cis"]:
        raise GpuError(NvmlCode.INSUFFICIENT_RESOURCES,
                       f"GI {gi_id} on GPU {gpu['index']} already has compute instance {gi['cis'][0]}")
    gi["cis"].append(0)
    return gi, 0


def destroy_ci(gpu: dict[str, Any], gi_id: int, ci_id: int, busy_gis: set[int]) -> None:
    require_mig(gpu, f"destroy compute instance {gi_id}/{ci_id}")
    gi = find_gi(gpu, gi_id)
    if ci_id not in gi["cis"]:
        raise GpuError(NvmlCode.NOT_FOUND, f"GI {gi_id} on GPU {gpu['index']} has no compute instance {ci_id}")
    if gi_id in busy_gis:
        raise GpuError(NvmlCode.IN_USE, f"compute instance {gi_id}/{ci_id} on GPU {gpu['index']} has running processes")
    gi["cis"].remove(ci_id)


def destroy_gi(gpu: dict[str, Any], gi_id: int) -> None:
    require_mig(gpu, f"destroy GPU instance {gi_id}")
    gi = find_gi(gpu, gi_id)
    if gi["cis"]:
        raise GpuError(NvmlCode.IN_USE,
                       f"GPU instance {gi_id} on GPU {gpu['index']} still has compute instances {gi['cis']}; "
                       "destroy them first")
    gpu["gpu_instances"].remove(gi)
