"""The GPU catalogue: the one table of GPU models every part of gpushare reads.

Why one table: the estimator sizes a job against a GPU's memory, the submit hook turns that size into
shards (one shard = 1 GiB of the GPU), the MIG planner needs each model's profiles and placements, and the
simulated device backend needs all of it to behave like the real card. Keeping them apart would let the
three disagree about what an "a100-40gb" is.

Sources: memory totals are what ``nvidia-smi``/``cudaMemGetInfo`` report for the whole card; MIG rows are
from `docs/mig-profiles.md` (NVIDIA MIG User Guide v580 listings). At run time NVML is the source of
truth; this table seeds the planner, the estimator and the simulated backend. Sites add models in the
config file (``[gpus.<name>]``).
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class GpuModel:
    """A whole GPU model as the cluster sees it."""

    name: str  # catalogue key, lower case: "a100-40gb"
    marketing_name: str  # what NVML's nvmlDeviceGetName returns (prefix match)
    total_bytes: int  # total device memory as NVML/nvidia-smi report it
    sms: int
    memory_slices: int = 0  # 0 when the model has no MIG
    mig_profiles: tuple[MigProfile, ...] = field(default=())

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
        GpuModel("a100-40gb", "NVIDIA A100-SXM4-40GB", 40960 * MiB, 108, 8, _A100_40_PROFILES),
        GpuModel("a100-80gb", "NVIDIA A100-SXM4-80GB", 81920 * MiB, 108, 8, _A100_80_PROFILES),
        GpuModel("h100-80gb", "NVIDIA H100 80GB HBM3", 81559 * MiB, 132, 8, _H100_PROFILES),
        GpuModel("h200-141gb", "NVIDIA H200", 143771 * MiB, 132, 8, _H200_PROFILES),
        GpuModel("a30-24gb", "NVIDIA A30", 24576 * MiB, 56, 4, _A30_PROFILES),
        GpuModel("l40s-48gb", "NVIDIA L40S", 46068 * MiB, 142),
        GpuModel("v100-32gb", "Tesla V100-SXM2-32GB", 32768 * MiB, 80),
        GpuModel("rtx3060-12gb", "NVIDIA GeForce RTX 3060", 12288 * MiB, 28),
        GpuModel("rtx4060-8gb", "NVIDIA GeForce RTX 4060", 8188 * MiB, 24),
    )
}


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
