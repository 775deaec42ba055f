"""Simulated GPUs: memory in use, DCGM-style utilisation, power and energy, as step functions of time.

Why step functions: between two simulator events nothing on a GPU changes, so memory, SMACT and power
are constant and energy integrates exactly; the 1 Hz telemetry window the risk code wants is sampled
from the recorded steps on demand (plus small seeded noise, so scores near a threshold behave like a
real, jittery DCGM series) instead of simulating every second.

Memory: a job holds a CUDA context (``CONTEXT_GIB``) from dispatch until its first kernel, then its peak.
Utilisation of co-running jobs (solo values from their class, ``workload.UTIL_CLASSES``): SMACT combines
as the chance that at least one is busy, ``1 − Π(1 − aᵢ)``; SMOCC and DRAMA add up, capped at 1.
Power: ``idle + (max − idle) · SMACT^0.7`` (sublinear in load, as CARMA §3.5 observes); idle and
maximum per model below are board idle draw and TDP from vendor datasheets (idle rounded from
nvidia-smi readings commonly reported; an assumption where no datasheet gives it).
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field

from gpushare.gpus import GiB, GpuModel

CONTEXT_GIB = 0.5
POWER_EXPONENT = 0.7
NOISE_SIGMA = 0.02
POWER_W: dict[str, tuple[float, float]] = {  # model -> (idle W, max W)
    "a100-40gb": (55.0, 400.0),
    "a100-80gb": (60.0, 400.0),
    "h100-80gb": (70.0, 700.0),
    "h200-141gb": (75.0, 700.0),
    "a30-24gb": (30.0, 165.0),
    "l40s-48gb": (35.0, 350.0),
    "v100-32gb": (40.0, 300.0),
    "rtx3060-12gb": (15.0, 170.0),
    "rtx4060-8gb": (10.0, 115.0),
}


_NOISE_LEN = 8191  # prime, so GPUs and seconds do not fall into step
_NOISE: dict[int, list[float]] = {}


def _noise(seed: int) -> list[float]:
    """A fixed table of N(0, NOISE_SIGMA) draws per seed: deterministic and cheap to index."""
    if seed not in _NOISE:
        rng = random.Random(seed)
        _NOISE[seed] = [rng.gauss(0.0, NOISE_SIGMA) for _ in range(_NOISE_LEN + 3)]
    return _NOISE[seed]


@dataclass
class Resident:
    """A job's footprint on one GPU."""

    job_id: str
    mem_bytes: int  # true peak
    util: tuple[float, float, float]  # solo SMACT, SMOCC, DRAMA
    shards: int
    active: bool = False  # first kernel seen


@dataclass
class SimGpu:
    index: int
    node: int
    model: GpuModel
    capacity_bytes: int
    seed: int = 0
    residents: dict[str, Resident] = field(default_factory=dict)
    exclusive: bool = False
    energy_j: float = 0.0
    _last_t: float = 0.0
    # step history: time, used bytes, SMACT, SMOCC, DRAMA, power W
    history: list[tuple[float, int, float, float, float, float]] = field(default_factory=list)
    _times: list[float] = field(default_factory=list)

    @property
    def shards_total(self) -> int:
        return int(self.capacity_bytes // GiB)

    @property
    def shards_free(self) -> int:
        return self.shards_total - sum(r.shards for r in self.residents.values())

    def used_bytes(self) -> int:
        ctx = int(CONTEXT_GIB * GiB)
        return sum(r.mem_bytes if r.active else ctx for r in self.residents.values())

    def utilisation(self) -> tuple[float, float, float]:
        idle, occ, dram = 1.0, 0.0, 0.0
        for r in self.residents.values():
            if r.active:
                idle *= 1.0 - r.util[0]
                occ += r.util[1]
                dram += r.util[2]
        return 1.0 - idle, min(1.0, occ), min(1.0, dram)

    def power_w(self) -> float:
        lo, hi = POWER_W.get(self.model.name, (50.0, 300.0))
        return lo + (hi - lo) * self.utilisation()[0] ** POWER_EXPONENT

    def advance(self, t: float) -> None:
        """Integrate energy up to ``t`` at the current (constant) power."""
        if t > self._last_t:
            self.energy_j += self.power_w() * (t - self._last_t)
            self._last_t = t

    def record(self, t: float) -> None:
        """Append the current state as a step starting at ``t`` (replacing a step at the same time)."""
        a, o, d = self.utilisation()
        point = (t, self.used_bytes(), a, o, d, self.power_w())
        if self.history and self.history[-1][0] == t:
            self.history[-1] = point
        else:
            self.history.append(point)
            self._times.append(t)

    def window(self, t: float, samples: int) -> list[tuple[float, float, float]]:
        """The last ``samples`` 1 Hz DCGM samples (SMACT, SMOCC, DRAMA) up to ``t``, with seeded noise."""
        times = self._times
        out = []
        end = int(t)
        for second in range(end - samples + 1, end + 1):
            k = bisect.bisect_right(times, second) - 1
            if k < 0:
                out.append((0.0, 0.0, 0.0))
                continue
            _, _, a, o, d = self.history[k][:5]
            if a > 0:
                n = (second * 3 + self.index * 7919) % _NOISE_LEN
                noise = _noise(self.seed)
                a = min(1.0, max(0.0, a + noise[n]))
                o = min(1.0, max(0.0, o + noise[n + 1]))
                d = min(1.0, max(0.0, d + noise[n + 2]))
            out.append((a, o, d))
        return out
