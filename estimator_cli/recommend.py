"""What to ask Slurm for, given a peak: a shared request in GiB shards, a MIG profile, or a whole GPU.

Pure policy (no I/O). The margin and thresholds are the cluster's ``[policy]`` settings
(gpushare/config.py), so the estimator's advice and the submit hook's rewrite agree. docs/architecture.md: a
shared job asks for ``shard:<estimate + margin in GiB>``; one shard is one GiB of the GPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from gpushare.config import PolicySection
from gpushare.gpus import GiB, GpuModel, MigProfile


@dataclass(frozen=True)
class Recommendation:
    kind: str  # "shared" | "exclusive" | "mig" | "does_not_fit"
    request: str  # the GRES to request, e.g. "shard:12", "gpu:1", "gpu:a100-40gb_3g.20gb:1"; "" if none
    margin_bytes: int  # safety margin added to peak_total_bytes
    needed_bytes: int  # peak_total_bytes + margin_bytes
    shard_gib: int | None  # shards (GiB) for a shared request
    mig_profile: str | None  # tightest MIG profile that holds needed_bytes, on MIG-capable models
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def margin_for(peak_total: int, policy: PolicySection) -> int:
    return max(int(peak_total * policy.margin_fraction), int(policy.margin_min_gib * GiB))


def tightest_mig(model: GpuModel, needed: int) -> MigProfile | None:
    fitting = [p for p in model.mig_profiles if p.usable_bytes >= needed and not p.media_extensions]
    return min(fitting, key=lambda p: (p.memory_slices, p.compute_slices, p.usable_bytes), default=None)


def recommend(peak_total: int, model: GpuModel, mig: MigProfile | None, policy: PolicySection,
              oom: bool) -> Recommendation:
    margin = margin_for(peak_total, policy)
    needed = peak_total + margin
    if mig is not None:  # the target is a MIG slice: it either holds the job or not
        if oom or needed > mig.usable_bytes:
            return Recommendation("does_not_fit", "", margin, needed, None, None,
                                  f"needs {needed / GiB:.1f} GiB with margin; {mig.name} has {mig.usable_gib:.2f} GiB")
        return Recommendation("mig", f"gpu:{model.name}_{mig.name}:1", margin, needed, None, mig.name,
                              f"fits {mig.name} ({mig.usable_gib:.2f} GiB) with margin")
    best_mig = tightest_mig(model, needed)
    if oom or peak_total > model.total_bytes:
        return Recommendation("does_not_fit", "", margin, needed, None, None,
                              f"peak {peak_total / GiB:.1f} GiB exceeds the {model.total_gib:.0f} GiB of {model.name}")
    if policy.shared == "none" or needed > policy.exclusive_above_fraction * model.total_bytes:
        why = ("shared requests are disabled ([policy] shared = none)" if policy.shared == "none" else
               f"estimate + margin is over {policy.exclusive_above_fraction:.0%} of the GPU")
        return Recommendation("exclusive", "gpu:1", margin, needed, None,
                              best_mig.name if best_mig else None, why)
    shards = max(1, math.ceil(needed / GiB))
    return Recommendation("shared", f"shard:{shards}", margin, needed, shards,
                          best_mig.name if best_mig else None,
                          f"{shards} of {model.shards} GiB shards ({needed / model.total_bytes:.0%} of the GPU)")
