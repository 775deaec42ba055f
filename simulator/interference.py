"""Interference: how fast a job runs next to others, from measured pairwise throughputs.

Source: Gavel's ``simulation_throughputs.json`` (Narayanan et al., OSDI'20; github.com/stanford-futuredata/
gavel, MIT licence), read in place from ``shared/data/`` (or ``--throughputs``), never copied. For a job
type A it holds A's solo throughput (key ``"null"``) and, for every other type B, the pair
``[A's throughput next to B, B's throughput next to A]``, measured on V100/P100/K80.

Model: Gavel gives the pairwise factor ``f(i, j) = thr(i next to j) / thr(i solo)``, i.e. the extra
time per unit of work ``x(i, j) = 1/f(i, j) − 1`` that co-runner j costs job i. Two assumptions turn that
into a speed on the simulated GPU for any number of co-runners J (jobs past their first kernel):

1. **Contention scaling.** Gavel measured on a V100 where these models nearly saturate the GPU. On the
   target GPU the measured extra time is scaled by how close the pair comes to saturating it,
   ``min(1, smact_i + smact_j)`` (solo SMACT of their utilisation classes): two light jobs that together
   use 60 % of the SMs pay 60 % of the measured penalty.
2. **Additive slowdowns.** Extra times add: ``speed(i, J) = 1 / (1 + Σ_{j∈J} x'(i, j))``. For one co-runner
   this is the (scaled) measured factor; for k identical co-runners at f = 0.5 it is plain time-slicing
   (each at 1/(k+1)), which is what MPS degrades to when compute is saturated.

Fallback, used when a job has no Gavel proxy or the pair is missing or 0 (Gavel stores 0 for pairs that
did not fit a 16 GB V100 together): ``f(i, j) = 0.95 · min(1, 1 / (smact_i + smact_j))``, i.e. the two
share the SMs in proportion once their solo SM activity adds up past 100 %, with 5 % for MPS context
switching and cache sharing.

``mode="share"`` ignores Gavel and uses only utilisation: all co-runners share the SMs in proportion to
their solo SMACT, ``speed = 0.95 · min(1, 1/Σ smact)``. It is the optimistic bound for jobs that leave
the GPU idle (input-bound training), and a way to see how much a result depends on the measured data.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

FALLBACK_OVERHEAD = 0.95
MODES = ("gavel", "share")


class Interference:
    """Pairwise speed factors; one instance per simulation (it caches the factors it computes)."""

    def __init__(self, table: dict[str, dict] | None = None, gpu_family: str = "v100", mode: str = "gavel") -> None:
        if mode not in MODES:
            raise ValueError(f"unknown interference model {mode!r}; use {' or '.join(MODES)}")
        self.mode = mode
        self._table = (table or {}).get(gpu_family, {}) if mode == "gavel" else {}
        self._cache: dict[tuple, float] = {}
        self.fallback_pairs: set[tuple[str, str]] = set()

    @classmethod
    def load(cls, path: str | Path | None, mode: str = "gavel", gpu_family: str = "v100") -> Interference:
        """Read Gavel's JSON; a missing file gives the fallback model only (reported by the caller)."""
        if mode != "gavel" or path is None or not Path(path).exists():
            return cls(None, mode=mode)
        with open(path) as handle:
            return cls(json.load(handle), gpu_family, mode)

    @property
    def measured(self) -> bool:
        return bool(self._table)

    def _measured(self, a: str | None, b: str | None) -> float | None:
        if not a or not b:
            return None
        row = self._table.get(f"('{a}', 1)")
        if not row:
            return None
        solo = row.get("null")
        pair = row.get(f"('{b}', 1)")
        if not solo or not pair or not pair[0]:
            return None
        return min(1.0, float(pair[0]) / float(solo))

    def pair(self, a: str | None, a_smact: float, b: str | None, b_smact: float) -> float:
        """f(a, b): a's speed next to b, relative to a alone."""
        key = (a, a_smact, b, b_smact)
        if key not in self._cache:
            value = self._measured(a, b)
            if value is None:
                self.fallback_pairs.add((a or "custom", b or "custom"))
                value = FALLBACK_OVERHEAD * min(1.0, 1.0 / max(a_smact + b_smact, 1e-9))
            self._cache[key] = value
        return self._cache[key]

    def speed(self, job: tuple[str | None, float], others: Sequence[tuple[str | None, float]]) -> float:
        """Speed of ``job`` = (gavel proxy, solo SMACT) next to ``others``; 1.0 alone."""
        if not others:
            return 1.0
        if self.mode == "share":
            return FALLBACK_OVERHEAD * min(1.0, 1.0 / (job[1] + sum(o[1] for o in others)))
        extra = 0.0
        for other in others:
            factor = self.pair(job[0], job[1], other[0], other[1])
            extra += (1.0 / max(factor, 1e-6) - 1.0) * min(1.0, job[1] + other[1])
        return 1.0 / (1.0 + extra)
