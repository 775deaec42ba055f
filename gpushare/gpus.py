"""The GPU catalogue: the one table of GPU models every part of gpushare reads.

Why one table: the estimator sizes a job against a GPU's memory, the submit hook turns that size into
shards (one shard = 1 GiB of the GPU), the MIG planner needs each model's profiles and placements, and the
simulated device backend needs all of it to behave like the real card. Keeping them apart would let the
three disagree about what an "a100-40gb" is.

Sources: memory totals are what ``nvidia-smi``/``cudaMemGetInfo`` report for the whole card; MIG rows are
from `docs/mig-profiles.md` (NVIDIA MIG User Guide v580 listings). At run time NVML is the source of
truth; this table seeds the planner, the estimator and the simulated backend. Sites add models in the
config file (``[gpus.<name>]``).

Every per-model figure lives on :class:`GpuModel`, here and nowhere else: memory, SMs, MIG profiles, the
compute capability (which sizes the CUDA context, :mod:`gpushare.cuda_context`, and the reduction kernels'
grids) and the power range the simulated backend draws. A site model from the config file gets the same
figures: its compute capability from its NVML marketing name unless the file gives it, the default power
range unless the file gives one. ``tests/core/test_catalogue_home.py`` checks that no other module keeps a
table keyed by model name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

KiB = 1 << 10  # the one definition of the binary units; everyone imports these
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile of a MIG-capable model."""

    name: str  # e.g. "3g.20gb"; "+me" variants carry the media extensions
    gi_profile_id: int  # nvmlGpuInstanceProfileInfo_t.id (differs between models)
    compute_slices: int  # the "Ng" part: SM slices out of 7 (4 on A30)
    memory_slices: int  # placement size in memory slices (8 per GPU, 4 on A30)
    usable_bytes: int  # memory a CUDA process can use inside the instance
    sms: int  # streaming multiprocessors
    max_count: int  # how many of this profile fit on an empty GPU
    placements: tuple[int, ...]  # legal start memory slices
    media_extensions: bool = False

    @property
    def usable_gib(self) -> float:
        return self.usable_bytes / GiB


# Compute capability of a model the catalogue does not list with one: its NVML marketing name.
_SM_ARCH_BY_MARKETING = (
    (re.compile(r"\b(B100|B200|GB200)\b"), (10, 0)),
    (re.compile(r"\b(H100|H200|H800|GH200)\b"), (9, 0)),
    (re.compile(r"\b(L4|L40S?|RTX 40\d\d|RTX 6000 Ada)\b"), (8, 9)),
    (re.compile(r"\b(A100|A30|A800)\b"), (8, 0)),
    (re.compile(r"\b(A10|A40|A16|A2|RTX 30\d\d|RTX A\d000)\b"), (8, 6)),
    (re.compile(r"\b(T4|RTX 20\d\d)\b"), (7, 5)),
    (re.compile(r"\bV100\b"), (7, 0)),
)
DEFAULT_SM_ARCH = (8, 0)
# Idle and maximum board power of a model the catalogue gives none for (the simulated backend's power).
DEFAULT_POWER_W = (50.0, 300.0)
# maxThreadsPerMultiProcessor by compute capability (CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability"); anything not listed takes 2048.
MAX_THREADS_PER_SM = {(7, 5): 1024, (8, 6): 1536, (8, 9): 1536, (12, 0): 1536, (12, 1): 1536}


def sm_arch_from_marketing_name(marketing_name: str) -> tuple[int, int]:
    """Compute capability by the NVML marketing name (``DEFAULT_SM_ARCH`` when no family matches)."""
    for pattern, arch in _SM_ARCH_BY_MARKETING:
        if pattern.search(marketing_name):
            return arch
    return DEFAULT_SM_ARCH


def max_threads_per_sm(sm_arch: tuple[int, int]) -> int:
    return MAX_THREADS_PER_SM.get(sm_arch, 2048)


@dataclass(frozen=True)
class GpuModel:
    """A whole GPU model as the cluster sees it."""

    name: str  # catalogue key, lower case: "a100-40gb"
    marketing_name: str  # what NVML's nvmlDeviceGetName returns (prefix match)
    total_bytes: int  # total device memory as NVML/nvidia-smi report it
    sms: int
    memory_slices: int = 0  # 0 when the model has no MIG
    mig_profiles: tuple[MigProfile, ...] = field(default=())
    sm_arch: tuple[int, int] = (0, 0)  # compute capability; (0, 0): from the marketing name at construction
    power_w: tuple[float, float] = DEFAULT_POWER_W  # (idle W, max W): datasheet TDP, typical idle draw

    def __post_init__(self) -> None:
        if self.sm_arch == (0, 0):
            object.__setattr__(self, "sm_arch", sm_arch_from_marketing_name(self.marketing_name or self.name))

    @property
    def max_threads_per_sm(self) -> int:
        return max_threads_per_sm(self.sm_arch)

    def context_bytes(self, *, uses_cublas: bool = True, uses_cudnn: bool = True) -> int:
        """CUDA context plus the library kernels a training step loads (:mod:`gpushare.cuda_context`)."""
        from gpushare.cuda_context import context_bytes_for

        return context_bytes_for(self.sm_arch, uses_cublas=uses_cublas, uses_cudnn=uses_cudnn)

    def find_mig_profile(self, name: str | None) -> MigProfile | None:
        """The profile called ``name`` (None: none such)."""
        return find_mig_profile((self,), name)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GiB

    @property
    def shards(self) -> int:
        """Shard count for gres.conf: one shard per whole GiB of device memory."""
        return int(self.total_bytes // GiB)

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)

    def mig_profile(self, name: str) -> MigProfile:
        for profile in self.mig_profiles:
            if profile.name == name:
                return profile
        known = ", ".join(p.name for p in self.mig_profiles) or "none"
        raise KeyError(f"{self.name} has no MIG profile {name!r} (known: {known})")


def find_mig_profile(models: Iterable[GpuModel], name: str | None) -> MigProfile | None:
    """The first profile called ``name`` on ``models`` in their order (None: none, or no name). Profile names
    repeat across models (``1g.10gb`` is an A100-40GB 1g.2x and an A100-80GB 1g): pass the node's own model
    first, or one model, where the sizes matter."""
    if not name:
        return None
    return next((p for m in models for p in m.mig_profiles if p.name == name), None)


def _gib(value: float) -> int:
    return int(round(value * GiB))


def _ampere_hopper_profiles(
    names: dict[str, str], usable: dict[str, float], sms: dict[str, int]
) -> tuple[MigProfile, ...]:
    """A100/H100/H200 share ids, slice counts and placements; only names, sizes and SMs differ."""
    shape = {  # key: (gi id, compute slices, memory slices, max count, placements, media ext)
        "1g": (19, 1, 1, 7, (0, 1, 2, 3, 4, 5, 6), False),
        "1g+me": (20, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6), True),
        "1g.2x": (15, 1, 2, 4, (0, 2, 4, 6), False),
        "2g": (14, 2, 2, 3, (0, 2, 4), False),
        "3g": (9, 3, 4, 2, (0, 4), False),
        "4g": (5, 4, 4, 1, (0,), False),
        "7g": (0, 7, 8, 1, (0,), False),
    }
    out = []
    for key, (gid, cs, ms, mx, places, me) in shape.items():
        out.append(
            MigProfile(
                name=names[key],
                gi_profile_id=gid,
                compute_slices=cs,
                memory_slices=ms,
                usable_bytes=_gib(usable[key]),
                sms=sms[key],
                max_count=mx,
                placements=places,
                media_extensions=me,
            )
        )
    return tuple(out)


_A100_40_PROFILES = _ampere_hopper_profiles(
    names={"1g": "1g.5gb", "1g+me": "1g.5gb+me", "1g.2x": "1g.10gb", "2g": "2g.10gb",
           "3g": "3g.20gb", "4g": "4g.20gb", "7g": "7g.40gb"},
    usable={"1g": 4.75, "1g+me": 4.75, "1g.2x": 9.62, "2g": 9.62, "3g": 19.50, "4g": 19.50, "7g": 39.25},
    sms={"1g": 14, "1g+me": 14, "1g.2x": 14, "2g": 28, "3g": 42, "4g": 56, "7g": 98},
)
_A100_80_PROFILES = _ampere_hopper_profiles(
    names={"1g": "1g.10gb", "1g+me": "1g.10gb+me", "1g.2x": "1g.20gb", "2g": "2g.20gb",
           "3g": "3g.40gb", "4g": "4g.40gb", "7g": "7g.80gb"},
    usable={"1g": 9.50, "1g+me": 9.50, "1g.2x": 19.50, "2g": 19.50, "3g": 39.25, "4g": 39.25, "7g": 79.0},
    sms={"1g": 14, "1g+me": 14, "1g.2x": 14, "2g": 28, "3g": 42, "4g": 56, "7g": 98},
)
_H100_PROFILES = _ampere_hopper_profiles(
    names={"1g": "1g.10gb", "1g+me": "1g.10gb+me", "1g.2x": "1g.20gb", "2g": "2g.20gb",
           "3g": "3g.40gb", "4g": "4g.40gb", "7g": "7g.80gb"},
    usable={"1g": 9.75, "1g+me": 9.75, "1g.2x": 19.62, "2g": 19.62, "3g": 39.50, "4g": 39.50, "7g": 79.25},
    sms={"1g": 16, "1g+me": 16, "1g.2x": 26, "2g": 32, "3g": 60, "4g": 64, "7g": 132},
)
# H200: ids 19/20/14/0 confirmed; 15/9/5 by analogy with H100 (docs/mig-profiles.md).
_H200_PROFILES = _ampere_hopper_profiles(
    names={"1g": "1g.18gb", "1g+me": "1g.18gb+me", "1g.2x": "1g.35gb", "2g": "2g.35gb",
           "3g": "3g.71gb", "4g": "4g.71gb", "7g": "7g.141gb"},
    usable={"1g": 16.0, "1g+me": 16.0, "1g.2x": 32.5, "2g": 32.5, "3g": 69.8, "4g": 69.8, "7g": 140.0},
    sms={"1g": 16, "1g+me": 16, "1g.2x": 26, "2g": 32, "3g": 60, "4g": 64, "7g": 132},
)
_A30_PROFILES = (
    MigProfile("1g.6gb", 14, 1, 1, _gib(5.81), 14, 4, (0, 1, 2, 3)),
    MigProfile("1g.6gb+me", 21, 1, 1, _gib(5.81), 14, 1, (0, 1, 2, 3), media_extensions=True),
    MigProfile("2g.12gb", 5, 2, 2, _gib(11.69), 28, 2, (0, 2)),
    MigProfile("2g.12gb+me", 6, 2, 2, _gib(11.69), 28, 1, (0, 2), media_extensions=True),
    MigProfile("4g.24gb", 0, 4, 4, _gib(23.5), 56, 1, (0,)),
)

BUILTIN_GPUS: dict[str, GpuModel] = {
    m.name: m
    for m in (
        GpuModel("a100-40gb", "NVIDIA A100-SXM4-40GB", 40960 * MiB, 108, 8, _A100_40_PROFILES,
                 sm_arch=(8, 0), power_w=(55.0, 400.0)),
        GpuModel("a100-80gb", "NVIDIA A100-SXM4-80GB", 81920 * MiB, 108, 8, _A100_80_PROFILES,
                 sm_arch=(8, 0), power_w=(60.0, 400.0)),
        GpuModel("h100-80gb", "NVIDIA H100 80GB HBM3", 81559 * MiB, 132, 8, _H100_PROFILES,
                 sm_arch=(9, 0), power_w=(70.0, 700.0)),
        GpuModel("h200-141gb", "NVIDIA H200", 143771 * MiB, 132, 8, _H200_PROFILES,
                 sm_arch=(9, 0), power_w=(75.0, 700.0)),
        GpuModel("a30-24gb", "NVIDIA A30", 24576 * MiB, 56, 4, _A30_PROFILES,
                 sm_arch=(8, 0), power_w=(30.0, 165.0)),
        GpuModel("l40s-48gb", "NVIDIA L40S", 46068 * MiB, 142, sm_arch=(8, 9), power_w=(35.0, 350.0)),
        GpuModel("v100-32gb", "Tesla V100-SXM2-32GB", 32768 * MiB, 80, sm_arch=(7, 0), power_w=(40.0, 300.0)),
        GpuModel("rtx3060-12gb", "NVIDIA GeForce RTX 3060", 12288 * MiB, 28, sm_arch=(8, 6),
                 power_w=(15.0, 170.0)),
        GpuModel("rtx4060-8gb", "NVIDIA GeForce RTX 4060", 8188 * MiB, 24, sm_arch=(8, 9),
                 power_w=(10.0, 115.0)),
    )
}


def sm_arch_of(name: str | None, marketing_name: str = "") -> tuple[int, int]:
    """Compute capability of a built-in model by key, else of any GPU by its NVML marketing name."""
    if name in BUILTIN_GPUS:
        return BUILTIN_GPUS[name].sm_arch
    return sm_arch_from_marketing_name(marketing_name or name or "")


def parse_target(name: str, catalogue: dict[str, GpuModel] | None = None) -> tuple[GpuModel, MigProfile | None]:
    """Resolve "a100-40gb" or "a100-40gb:3g.20gb" to the model and optional MIG profile.

    Raises ValueError with a message that lists the known names, for CLI flags and config keys alike.
    """
    table = BUILTIN_GPUS if catalogue is None else catalogue
    model_name, _, profile_name = name.strip().lower().partition(":")
    if model_name not in table:
        raise ValueError(f"unknown GPU {model_name!r}; known: {', '.join(sorted(table))}")
    model = table[model_name]
    if not profile_name:
        return model, None
    try:
        return model, model.mig_profile(profile_name)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None


def capacity_bytes(model: GpuModel, profile: MigProfile | None) -> int:
    """Memory a job can use on a target: the whole card, or the MIG instance's usable memory."""
    return model.total_bytes if profile is None else profile.usable_bytes
