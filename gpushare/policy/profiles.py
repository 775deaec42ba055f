"""MIG profile selection, the NVML-shaped constructor, and tightest-fit sizing.

Why this module exists: the planner and the state machine must work for any MIG-capable model without
code changes. The built-in models come from the one GPU catalogue (:mod:`gpushare.gpus`); a model the
catalogue does not know is built at run time from what NVML reports per GPU-instance profile (name, id,
memory slices, compute slices, placements) by :func:`model_from_nvml`, into the very same
:class:`~gpushare.gpus.GpuModel` structure.

Profile sets. NVIDIA's guide lists, per model, one profile per compute size ("the classic five" on
A100/H100/H200: 1g, 2g, 3g, 4g, 7g; three on A30) plus variants: a 1g with twice the memory (GI id 15 on
A100/H100/H200) and ``+me`` profiles that own the media engines. The variants multiply the number of
layouts (A100: 19 maximal layouts with the classic five, 78 with the double-memory 1g), so they are opt-in:
:func:`select_profiles` picks the classic set and adds variants on request. "Classic" is derived from the
data, not from names: for each compute-slice count, the non-media profile with the fewest memory slices.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Union

from gpushare.gpus import GiB, GpuModel, MigProfile

# An NVML-like record: (name, gi profile id, memory slices, compute slices, placements) and optionally
# (..., max count, usable bytes, SMs). Placements may be start slices or (start, size) pairs, the shape of
# nvmlGpuInstancePlacement_t. The fields differ in type (and come from NVML, JSON or tests as ints or numeric
# strings), so a record is a sequence of Any; profiles_from_nvml converts each field with int()/str().
NvmlProfileRecord = Sequence[Any]
PlacementLike = Union[int, tuple[int, int]]


def classic_profiles(model: GpuModel) -> tuple[MigProfile, ...]:
    """One profile per compute size: the non-media profile with the fewest memory slices."""
    best: dict[int, MigProfile] = {}
    for profile in model.mig_profiles:
        if profile.media_extensions:
            continue
        held = best.get(profile.compute_slices)
        if held is None or profile.memory_slices < held.memory_slices:
            best[profile.compute_slices] = profile
    return tuple(sorted(best.values(), key=_size_key))


def select_profiles(
    model: GpuModel, *, extra_memory: bool = False, media_extensions: bool = False
) -> tuple[str, ...]:
    """Names of the profiles the planner considers, classic set first, in the catalogue's order.

    ``extra_memory`` adds the double-memory variants (1g.10gb on A100-40GB); ``media_extensions`` adds
    the ``+me`` profiles.
    """
    if not model.mig_capable:
        raise ValueError(f"{model.name} does not support MIG")
    classic = {p.name for p in classic_profiles(model)}
    chosen = []
    for profile in model.mig_profiles:
        if profile.name in classic:
            chosen.append(profile.name)
        elif profile.media_extensions and media_extensions:
            chosen.append(profile.name)
        elif not profile.media_extensions and extra_memory:
            chosen.append(profile.name)
    return tuple(sorted(chosen, key=lambda n: _size_key(model.mig_profile(n))))


def all_profiles(model: GpuModel) -> tuple[str, ...]:
    """Every profile of the model (classic, double-memory and ``+me``)."""
    return select_profiles(model, extra_memory=True, media_extensions=True)


def _size_key(profile: MigProfile) -> tuple[int, int, int, bool, str]:
    return (profile.usable_bytes, profile.compute_slices, profile.memory_slices,
            profile.media_extensions, profile.name)


def total_compute_slices(profiles: Iterable[MigProfile]) -> int:
    """The GPU's compute-slice budget: that of its whole-GPU profile (7 on A100/H100, 4 on A30)."""
    return max(p.compute_slices for p in profiles)


def _starts(name: str, memory_slices: int, placements: Iterable[PlacementLike]) -> tuple[int, ...]:
    starts = []
    for item in placements:
        if isinstance(item, tuple):
            start, size = item
            if size != memory_slices:
                raise ValueError(f"profile {name}: placement {start}:{size} does not span "
                                 f"{memory_slices} memory slices")
        else:
            start = item
        starts.append(int(start))
    if not starts:
        raise ValueError(f"profile {name}: no placements")
    return tuple(sorted(set(starts)))


def profiles_from_nvml(records: Iterable[NvmlProfileRecord]) -> tuple[MigProfile, ...]:
    """Build :class:`MigProfile` rows from NVML-like records (see ``NvmlProfileRecord``).

    Missing optional fields are derived: max count = how many disjoint placements fit within the compute
    budget; usable bytes and SMs default to 0 (unknown) — sizing by memory then needs them.
    """
    rows = [tuple(r) for r in records]
    if not rows:
        raise ValueError("no MIG profiles given")
    budget = max(int(r[3]) for r in rows)
    out = []
    for row in rows:
        if not 5 <= len(row) <= 8:
            raise ValueError(f"profile record {row!r}: expected 5 to 8 fields")
        name, gid, mem, comp, places = str(row[0]), int(row[1]), int(row[2]), int(row[3]), row[4]
        starts = _starts(name, mem, places)
        disjoint = _max_disjoint(starts, mem)
        max_count = int(row[5]) if len(row) > 5 else min(disjoint, budget // comp)
        usable = int(row[6]) if len(row) > 6 else 0
        sms = int(row[7]) if len(row) > 7 else 0
        out.append(MigProfile(name=name, gi_profile_id=gid, compute_slices=comp, memory_slices=mem,
                              usable_bytes=usable, sms=sms, max_count=max_count, placements=starts,
                              media_extensions="+me" in name))
    return tuple(out)


def _max_disjoint(starts: tuple[int, ...], size: int) -> int:
    count, end = 0, -1
    for start in starts:
        if start > end:
            count, end = count + 1, start + size - 1
    return count


def model_from_nvml(
    name: str,
    records: Iterable[NvmlProfileRecord],
    *,
    total_bytes: int = 0,
    sms: int = 0,
    marketing_name: str = "",
) -> GpuModel:
    """A :class:`GpuModel` for a GPU the catalogue does not know, from its NVML profile listing."""
    profiles = profiles_from_nvml(records)
    memory_slices = max(max(p.placements) + p.memory_slices for p in profiles)
    return GpuModel(name=name.lower(), marketing_name=marketing_name or name, total_bytes=total_bytes,
                    sms=sms, memory_slices=memory_slices, mig_profiles=profiles)


def needed_bytes(estimate_bytes: int, margin_fraction: float = 0.10, margin_min_bytes: int = GiB) -> int:
    """Estimate plus the safety margin: the larger of a fraction and a floor (the config's defaults)."""
    if estimate_bytes < 0:
        raise ValueError(f"memory estimate must be >= 0, got {estimate_bytes}")
    return estimate_bytes + max(int(estimate_bytes * margin_fraction), margin_min_bytes)


def tightest_profile(
    model: GpuModel,
    estimate_bytes: int,
    *,
    margin_fraction: float = 0.10,
    margin_min_bytes: int = GiB,
    profiles: Sequence[str] | None = None,
) -> MigProfile | None:
    """The smallest profile whose usable memory holds estimate + margin (MIGM §2.2 "tightest partition").

    Ties on memory go to fewer compute slices (3g.20gb before 4g.20gb): the job asked for memory, and
    the cheaper profile leaves more of the GPU to others. None when nothing is big enough.
    """
    need = needed_bytes(estimate_bytes, margin_fraction, margin_min_bytes)
    names = select_profiles(model) if profiles is None else tuple(profiles)
    fitting = [model.mig_profile(n) for n in names if model.mig_profile(n).usable_bytes >= need]
    return min(fitting, key=_size_key) if fitting else None


def next_larger_profile(
    model: GpuModel, profile_name: str, *, profiles: Sequence[str] | None = None
) -> MigProfile | None:
    """The profile to retry on after an OOM: the smallest with strictly more usable memory (MIGM §4.3).

    Strictly more memory, so a 3g.20gb OOM goes to 7g.40gb, not to 4g.20gb (same memory, would OOM
    again). None when the profile is already the largest.
    """
    current = model.mig_profile(profile_name)
    names = select_profiles(model) if profiles is None else tuple(profiles)
    bigger = [model.mig_profile(n) for n in names
              if model.mig_profile(n).usable_bytes > current.usable_bytes]
    return min(bigger, key=_size_key) if bigger else None
