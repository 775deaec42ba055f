"""Simulated GPUs for the trace simulator, with the simulated device backend's semantics and formulas.

Why the backend's formulas (``gpushare.gres.sim_timeline``): they are what the node agent reads through the
simulated backend (memory, DCGM utilisation, power, the total-energy counter) with NVML's semantics, so the
numbers the policies see and the energy reported come from the same code the agent and the epilog are
tested against, not from a second model. The simulator drives the GPUs like a workload would — a process
per job and GPU appears at dispatch with a CUDA context (``CONTEXT_GIB``), grows to its peak at its first
kernel, ends — on a virtual clock (the simulation's ``now``). Why not the backend object itself: its state
holds every process ever started and is copied on each change, which made a trace of thousands of jobs
take minutes; here each GPU keeps only its running processes and a running energy sum, so a change costs
what that GPU holds (same numbers: ``tests/simulator/test_golden_tables.py``).

What stays here: Slurm's view (shards, exclusive holders), the job → process map, and a step history of
what the GPU reported at each change, from which the 1 Hz telemetry window is sampled on demand
(with small seeded noise, so scores near a threshold jitter as a real DCGM series does) instead of
ticking every second. Aggregation and power are the backend's: per-process SMACT/SMOCC/DRAMA add up,
capped at 1; power = idle + (max − idle)·min(1, ΣSMACT). Idle/max per model are the catalogue's
(``GpuModel.power_w``: datasheet TDPs and typical idle draws, an assumption where no datasheet gives idle).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpushare.gpus import GiB, MiB, GpuModel

CONTEXT_GIB = 0.5
NOISE_SIGMA = 0.02
_NOISE_LEN = 8191  # prime, so GPU indices and seconds do not fall into step
_NOISE: dict[int, list[float]] = {}


def _noise(seed: int) -> list[float]:
    """A fixed table of N(0, NOISE_SIGMA) draws per seed: deterministic and cheap to index."""
    if seed not in _NOISE:
        rng = random.Random(seed)
        _NOISE[seed] = [rng.gauss(0.0, NOISE_SIGMA) for _ in range(_NOISE_LEN + 3)]
    return _NOISE[seed]


def noise_bound(seed: int) -> float:
    """The largest |noise| of a seed's table: no sample of a window moves further from its step value."""
    return max(abs(x) for x in _noise(seed))


_SCORES: dict[tuple[int, int, int], tuple[float, float, float]] = {}


def noise_scores(seed: int, start: int, samples: int) -> tuple[float, float, float]:
    """The risk scores (``gpushare.policy.risk.score``) of the noise alone over a window whose first sample
    has noise index ``start``, for SMACT, SMOCC and DRAMA. A score is a weighted mean (weights summing to 1)
    of statistics that all shift with their samples, so a steady window that the noise never pushes past
    0 or 1 scores its step value plus these, to rounding."""
    key = (seed, start, samples)
    if key not in _SCORES:
        from gpushare.policy.risk import score

        noise = _noise(seed)
        at = [(start + 3 * k) % _NOISE_LEN for k in range(samples)]
        _SCORES[key] = (score([noise[n] for n in at]), score([noise[n + 1] for n in at]),
                        score([noise[n + 2] for n in at]))
    return _SCORES[key]


@dataclass
class Resident:
    """A job's footprint on one GPU."""

    job_id: str
    pid: int  # its process in the backend
    mem_bytes: int  # true peak
    util: tuple[float, float, float]  # solo SMACT, SMOCC, DRAMA
    shards: int
    active: bool = False  # first kernel seen


@dataclass
class SimGpu:
    index: int
    node: int
    capacity_bytes: int  # whole card, or the MIG profile's usable memory
    residents: dict[str, Resident] = field(default_factory=dict)
    exclusive: bool = False
    version: int = 0  # changes recorded so far
    # step history of what the backend reported: time, used bytes, SMACT, SMOCC, DRAMA, power W
    history: list[tuple[float, int, float, float, float, float]] = field(default_factory=list)
    _times: list[float] = field(default_factory=list)

    @property
    def shards_total(self) -> int:
        return int(self.capacity_bytes // GiB)

    @property
    def shards_free(self) -> int:
        return self.shards_total - sum(r.shards for r in self.residents.values())

    def window_range(self, t: float, samples: int) -> tuple[tuple[float, float], ...]:
        """(lowest, highest) SMACT, SMOCC and DRAMA of the steps the window up to ``t`` samples, before
        noise: a risk verdict that holds for every value in these ranges widened by the noise needs no
        window (``Simulation``'s views)."""
        end = int(t)
        first = bisect.bisect_right(self._times, end - samples + 1) - 1
        last = bisect.bisect_right(self._times, end) - 1
        points = [p[2:5] for p in self.history[max(first, 0):last + 1]]
        if first < 0:
            points.append((0.0, 0.0, 0.0))
        return tuple((min(p[k] for p in points), max(p[k] for p in points)) for k in range(3))

    def steady(self, t: float, samples: int) -> tuple[tuple[float, float, float], int] | None:
        """When the window up to ``t`` lies within one step of a busy GPU: that step's (SMACT, SMOCC, DRAMA)
        and the noise index of its first sample (``noise_scores``); None otherwise."""
        end = int(t)
        k = bisect.bisect_right(self._times, end - samples + 1) - 1
        if k < 0 or k + 1 < len(self._times) and self._times[k + 1] <= end:
            return None
        values = self.history[k][2:5]
        if not values[0] > 0:
            return None
        return values, ((end - samples + 1) * 3 + self.index * 7919) % _NOISE_LEN

    def window(self, t: float, samples: int, seed: int) -> list[tuple[float, float, float]]:
        """The last ``samples`` 1 Hz samples (SMACT, SMOCC, DRAMA) up to ``t``, with seeded noise."""
        return list(zip(*self.window_series(t, samples, seed)))

    def window_series(self, t: float, samples: int, seed: int) -> tuple[list[float], list[float], list[float]]:
        """``window`` as three series (SMACT, SMOCC, DRAMA), step by step rather than second by second."""
        noise = _noise(seed)
        end = int(t)
        first = end - samples + 1
        smact: list[float] = []
        smocc: list[float] = []
        drama: list[float] = []
        k = bisect.bisect_right(self._times, first) - 1
        second = first
        while second <= end:
            upto = end if k + 1 >= len(self._times) else min(end, math.ceil(self._times[k + 1]) - 1)
            if k < 0:
                zeros = [0.0] * (upto - second + 1)
                smact += zeros
                smocc += zeros
                drama += zeros
            else:
                a, o, d = self.history[k][2:5]
                for s in range(second, upto + 1):
                    if a > 0:
                        n = (s * 3 + self.index * 7919) % _NOISE_LEN
                        smact.append(min(1.0, max(0.0, a + noise[n])))
                        smocc.append(min(1.0, max(0.0, o + noise[n + 1])))
                        drama.append(min(1.0, max(0.0, d + noise[n + 2])))
                    else:
                        smact.append(a)
                        smocc.append(o)
                        drama.append(d)
            second = upto + 1
            k += 1
        return smact, smocc, drama


class SimCluster:
    """N nodes × M GPUs of one model; ``clock`` returns the simulation's time.

    Each GPU keeps only its running processes, as the backend's timeline entries
    (``gpushare.gres.sim_timeline``), and its energy counter as a running sum of power × time over the
    segments between changes: the same formulas as ``SimBackend`` (whose in-memory store copies the whole
    state, every process ever started, on each change, and integrates energy from the epoch on each read),
    at a cost per change that depends on the GPU's own processes only.
    """

    def __init__(self, model: GpuModel, capacity: int, nodes: int, per_node: int, clock: Callable[[], float]):
        idle, peak = model.power_w
        self.clock = clock
        self.model_name = model.name
        self.power_w = model.power_w
        self.gpus = [SimGpu(i, i // per_node, capacity) for i in range(nodes * per_node)]
        self._power = [{"index": i, "idle_power_w": idle, "max_power_w": peak} for i in range(len(self.gpus))]
        self._procs: list[dict[str, dict[str, Any]]] = [{} for _ in self.gpus]  # per GPU: job -> process
        self._used = [0] * len(self.gpus)  # bytes held by the running processes (uncapped)
        self._joules = [0.0] * len(self.gpus)  # energy up to _since, at the power of history[-1]
        self._since = [0.0] * len(self.gpus)
        self._next_pid = 1000
        self.changes = 0  # how many changes so far, on any GPU
        self.changed: set[int] = set()  # GPUs changed since the engine last updated rates
        self.touched: set[int] = set()  # GPUs changed since the engine last refreshed its views

    def used_bytes(self, gpu: int) -> int:
        return min(self._used[gpu], self.gpus[gpu].capacity_bytes)

    def _hold(self, gpu: int, proc: dict[str, Any], mem_bytes: int) -> None:
        self._used[gpu] += int(mem_bytes / MiB * MiB) - int(proc["memory_mib"] * MiB)
        proc["memory_mib"] = mem_bytes / MiB

    def _integrate(self, gpu: int) -> None:
        """Add the energy since the last change, at the power recorded then (power is constant between)."""
        t = self.clock()
        history = self.gpus[gpu].history
        if history and t > self._since[gpu]:
            self._joules[gpu] += history[-1][5] * (t - self._since[gpu])
        self._since[gpu] = t

    def launch(self, gpu: int, job_id: str, mem_bytes: int, util: tuple[float, float, float], shards: int) -> None:
        """A job's process appears on ``gpu`` holding only its CUDA context."""
        self._next_pid += 1
        proc = {"pid": self._next_pid, "gpu": gpu, "start_s": self.clock(), "end_s": None, "memory_mib": 0.0,
                "smact": 0.0, "smocc": 0.0, "drama": 0.0}
        self._hold(gpu, proc, int(CONTEXT_GIB * GiB))
        self._procs[gpu][job_id] = proc
        self.gpus[gpu].residents[job_id] = Resident(job_id, self._next_pid, mem_bytes, util, shards)
        self.record(gpu)

    def first_kernel(self, gpu: int, job_id: str, mem_bytes: int | None = None) -> None:
        """The job's first kernel: memory grows to its peak (or ``mem_bytes``) and it starts loading the GPU."""
        resident = self.gpus[gpu].residents[job_id]
        proc = self._procs[gpu][job_id]
        self._hold(gpu, proc, resident.mem_bytes if mem_bytes is None else mem_bytes)
        proc["smact"], proc["smocc"], proc["drama"] = resident.util
        resident.active = True
        self.record(gpu)

    def grow(self, gpu: int, job_id: str, mem_bytes: int) -> None:
        """A running job's memory changes (it outgrows its share)."""
        self._hold(gpu, self._procs[gpu][job_id], mem_bytes)
        self.record(gpu)

    def show(self, gpu: int, job_id: str, **activity: float) -> None:
        """What DCGM reports of a job's process changes (smact/smocc/drama): lanes, thread caps."""
        self._procs[gpu][job_id].update(activity)
        self.record(gpu)

    def end(self, gpu: int, job_id: str) -> None:
        proc = self._procs[gpu].pop(job_id)
        self._used[gpu] -= int(proc["memory_mib"] * MiB)
        del self.gpus[gpu].residents[job_id]
        self.gpus[gpu].exclusive = self.gpus[gpu].exclusive and bool(self.gpus[gpu].residents)
        self.record(gpu)

    def record(self, gpu: int) -> None:
        """Append what the GPU reports now as a step (replacing a step at the same time)."""
        self._integrate(gpu)
        self.changes += 1
        self.changed.add(gpu)
        self.touched.add(gpu)
        t = self.clock()
        # tl.activity's sum, in its order, written out: every process here is running and has no steps
        smact = smocc = drama = 0.0
        for proc in self._procs[gpu].values():
            smact += proc["smact"]
            smocc += proc["smocc"]
            drama += proc["drama"]
        smact, smocc, drama = min(1.0, smact), min(1.0, smocc), min(1.0, drama)
        power = self._power[gpu]  # tl.power_at's formula on the activity just aggregated (not aggregated twice)
        watts = power["idle_power_w"] + (power["max_power_w"] - power["idle_power_w"]) * smact
        point = (t, self.used_bytes(gpu), float(smact), float(smocc), float(drama), float(watts))
        sim_gpu = self.gpus[gpu]
        sim_gpu.version += 1
        if sim_gpu.history and sim_gpu.history[-1][0] == t:
            sim_gpu.history[-1] = point
        else:
            sim_gpu.history.append(point)
            sim_gpu._times.append(t)

    def energy_j(self, gpu: int) -> float:
        """The GPU's total-energy counter now, in joules, at the backend's millijoule resolution."""
        self._integrate(gpu)
        return int(round(self._joules[gpu] * 1000.0)) / 1000.0
