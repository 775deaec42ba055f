"""Interference: how fast a job runs next to others, from measured pairwise throughputs.

Source: Gavel's ``simulation_throughputs.json`` (Narayanan et al., OSDI'20; github.com/stanford-futuredata/
gavel, MIT licence), shipped in ``simulator/data/`` (or ``--throughputs``). For a job
type A it holds A's solo throughput (key ``"null"``) and, for every other type B, the pair
``[A's throughput next to B, B's throughput next to A]``, measured on V100/P100/K80.

Model. Gavel gives the pairwise factor ``f(i, j) = thr(i next to j) / thr(i solo)``, i.e. the extra time
per unit of work ``x(i, j) = 1/f(i, j) − 1`` that co-runner j costs job i. On the simulated GPU, for the
set J of co-runners past their first kernel::

    speed(i, J) = 0.95 / (1 + Σ_{j∈J} x'(i, j))

* 0.95: MPS context switching and cache sharing, paid by any co-running job (our assumption).
* **Extra times add** (Gavel measured pairs only): for k identical co-runners at f = 0.5 this is plain
  time-slicing, each at 1/(k+1), which is what sharing degrades to once compute is saturated.
* ``x'`` by mode:

  ``gavel`` (default)  measured ``x`` scaled by the pair's over-subscription of the target GPU,
                       ``clip(smact_i + smact_j − 1, 0, 1)`` (solo SMACT of their utilisation classes).
                       Gavel's V100 runs saturate the GPU with either job alone, so its penalty is the one
                       for a fully over-subscribed pair; two light jobs that together use 60 % of an
                       A100's SMs pay none of it, two medium ones (120 %) a fifth.
  ``gavel-raw``        measured ``x`` unscaled: as if the target GPU were a V100 (pessimistic bound).
  ``share``            no measurements: co-runners share the SMs in proportion to their solo SMACT,
                       ``speed = 0.95 · min(1, 1/Σ smact)`` (optimistic bound, input-bound jobs).

Fallback, for a job without a Gavel proxy, a missing pair, or a 0 in Gavel's table (pairs that did not
fit a 16 GB V100 together): ``x' = max(0, smact_i + smact_j − 1)``, the proportional SM share of the
pair; the pairs that used it are counted in ``fallback_pairs`` and reported.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

OVERHEAD = 0.95
MODES = ("gavel", "gavel-raw", "share")


class Interference:
    """Pairwise extra times; one instance per simulation (it caches what it computes)."""

    def __init__(self, table: dict[str, dict] | None = None, gpu_family: str = "v100", mode: str = "gavel") -> None:
        if mode not in MODES:
            raise ValueError(f"unknown interference model {mode!r}; use {', '.join(MODES)}")
        self.mode = mode
        self._table = (table or {}).get(gpu_family, {}) if mode != "share" else {}
        self._cache: dict[tuple, float] = {}
        self.fallback_pairs: set[tuple[str, str]] = set()
        self._kinds: dict[tuple[str | None, float], int] = {}  # (proxy, SMACT) -> its number
        self._kind_list: list[tuple[str | None, float]] = []
        self._rows: list[list[float | None]] = []  # _rows[a][b]: extra(a, b), None until first needed

    @classmethod
    def load(cls, path: str | Path | None, mode: str = "gavel", gpu_family: str = "v100") -> Interference:
        """Read Gavel's JSON; a missing file gives the fallback model only (the report says so)."""
        if mode == "share" or path is None or not Path(path).exists():
            return cls(None, mode=mode)
        with open(path) as handle:
            return cls(json.load(handle), gpu_family, mode)

    @property
    def measured(self) -> bool:
        return bool(self._table)

    def measured_factor(self, a: str | None, b: str | None) -> float | None:
        """Gavel's f(a, b), or None when the table has no usable value."""
        if not a or not b:
            return None
        row = self._table.get(f"('{a}', 1)")
        if not row:
            return None
        solo, pair = row.get("null"), row.get(f"('{b}', 1)")
        if not solo or not pair or not pair[0]:
            return None
        return min(1.0, float(pair[0]) / float(solo))

    def extra(self, a: str | None, a_smact: float, b: str | None, b_smact: float) -> float:
        """x'(a, b): the extra time per unit of work co-runner b costs a on the simulated GPU."""
        key = (a, a_smact, b, b_smact)
        if key not in self._cache:
            over = min(1.0, max(0.0, a_smact + b_smact - 1.0))
            factor = self.measured_factor(a, b)
            if factor is None:
                self.fallback_pairs.add((a or "custom", b or "custom"))
                value = over
            else:
                value = (1.0 / max(factor, 1e-6) - 1.0) * (1.0 if self.mode == "gavel-raw" else over)
            self._cache[key] = value
        return self._cache[key]

    def speed(self, job: tuple[str | None, float], others: Sequence[tuple[str | None, float]]) -> float:
        """Speed of ``job`` = (gavel proxy, solo SMACT) next to ``others``, relative to running alone."""
        if not others:
            return 1.0
        if self.mode == "share":
            return OVERHEAD * min(1.0, 1.0 / (job[1] + sum(o[1] for o in others)))
        a, a_smact = job
        cache = self._cache  # the hot path of a large run: cached extras read without a call each
        found = [cache.get((a, a_smact, b, b_smact)) for b, b_smact in others]
        extras: list[float] = ([self.extra(a, a_smact, b, b_smact) for b, b_smact in others] if None in found
                               else found)  # type: ignore[assignment]  # no None left
        return OVERHEAD / (1.0 + sum(extras))  # the same sum, in the same order, as one extra() per co-runner

    def kind(self, gavel: str | None, smact: float) -> int:
        """A small number for a job's (proxy, solo SMACT), the index of ``speed_among``'s rows."""
        found = self._kinds.get((gavel, smact))
        if found is None:
            found = self._kinds[(gavel, smact)] = len(self._kind_list)
            self._kind_list.append((gavel, smact))
            for row in self._rows:
                row.append(None)
            self._rows.append([None] * len(self._kind_list))
        return found

    def speed_among(self, a: int, kinds: list[int], at: int) -> float:
        """``speed`` of the job at position ``at`` of ``kinds`` (a GPU's loading jobs, as ``kind`` numbers;
        ``a`` is its own) next to all the others; ``at`` < 0: next to all of them.

        Why: the engine's hot path on a large cluster. The extras are read from a row of numbers instead
        of a dictionary keyed by tuples, and summed in the same order as ``speed`` sums them, the job's own
        position counting as +0.0 (which leaves a float unchanged): the same speed to the last bit."""
        if len(kinds) == (1 if at >= 0 else 0):
            return 1.0
        if self.mode == "share":
            known = self._kind_list
            return self.speed(known[a], [known[b] for i, b in enumerate(kinds) if i != at])
        row = self._rows[a]
        extras = [row[b] for b in kinds]
        if at >= 0:
            extras[at] = 0.0
        if None in extras:
            mine = self._kind_list[a]
            for i, b in enumerate(kinds):
                if extras[i] is None:
                    extras[i] = row[b] = self.extra(*mine, *self._kind_list[b])
        return OVERHEAD / (1.0 + sum(extras))  # type: ignore[arg-type]  # no None left
