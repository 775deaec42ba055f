"""Which Slurm release the installed tools belong to, and what that release does differently.

Why one table of capabilities instead of version comparisons at call sites: the differences that matter
to us (docs/compatibility.md) are few and were each measured on real daemons of 22.05, 24.11 and 26.05;
naming them (``gres_separator``, ``scontrol_json`` …) keeps callers readable and lets a test walk the
table. Detection runs ``sinfo --version`` once per binary directory and process.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import total_ordering

_VERSION_RE = re.compile(r"(\d{2})\.(\d{2})(?:\.(\d+))?")


@total_ordering
@dataclass(frozen=True)
class SlurmVersion:
    major: int
    minor: int
    micro: int = 0

    @classmethod
    def parse(cls, text: str) -> "SlurmVersion":
        """``slurm-wlm 22.05.8`` / ``slurm 24.11.5`` / ``26.05`` → a version; ValueError otherwise."""
        match = _VERSION_RE.search(text or "")
        if not match:
            raise ValueError(f"not a Slurm version: {str(text)[:60]!r}")
        return cls(int(match.group(1)), int(match.group(2)), int(match.group(3) or 0))

    def __lt__(self, other: "SlurmVersion") -> bool:
        return (self.major, self.minor, self.micro) < (other.major, other.minor, other.micro)

    def __str__(self) -> str:
        return f"{self.major:02d}.{self.minor:02d}.{self.micro}"

    @property
    def release(self) -> str:
        """``22.05``: the release series, as sites and Debian name it."""
        return f"{self.major:02d}.{self.minor:02d}"

    # --- what differs (each row measured on real daemons; docs/compatibility.md) --------------------
    @property
    def gres_separator(self) -> str:
        """job_submit/lua hands ``tres_per_node`` as ``gres:gpu:1`` up to 22.05 and ``gres/gpu:1`` from 23.02,
        and refuses the other form when it is written back."""
        return "gres:" if self < _V23_02 else "gres/"

    @property
    def scontrol_json(self) -> bool:
        """``scontrol --json show job N``: structured single-job reads (22.05: unrecognised option)."""
        return self >= _V23_02

    @property
    def squeue_json_filters(self) -> bool:
        """``squeue --json -j N -t all`` filters server-side (22.05 ignores filters with --json)."""
        return self >= _V23_02

    @property
    def cgroup_disabled(self) -> bool:
        """``CgroupPlugin=disabled`` exists (and slurmd needs it where no cgroup file system is mounted)."""
        return self >= _V23_02

    @property
    def held_gres_across_names(self) -> bool:
        """A held job's GRES may change across names (``shard:9`` → ``gpu:1``); 22.05 refuses."""
        return self >= _V24_11

    @property
    def reconfigure_applies_gres(self) -> bool:
        """``scontrol reconfigure`` applies a changed file-backed GRES count; 22.05 needs both daemons
        restarted (slurmctld, then slurmd)."""
        return self >= _V24_11

    @property
    def mig_devices_with_shards(self) -> bool:
        """MIG jobs get their devices while ``shard`` is in GresTypes: not on 22.05, where jobs on a node's
        instances past its first gres.conf lines start with an empty CUDA_VISIBLE_DEVICES (measured,
        docs/mig.md); 24.11 and 26.05 give every job its device (releases in between, untested, are warned)."""
        return self >= _V24_11

    @property
    def least_loaded_shared_gres(self) -> bool:
        """``SelectTypeParameters=LL_SHARED_GRES``: shards go to the least-loaded GPU instead of first-fit."""
        return self >= _V24_11


_V23_02 = SlurmVersion(23, 2)
_V24_11 = SlurmVersion(24, 11)
# The releases this project is tested on, oldest first (tests/ run the Slurm-marked tests on each).
SUPPORTED = ("22.05", "24.11", "26.05")
