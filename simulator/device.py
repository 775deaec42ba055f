"""Simulated GPUs for the trace simulator, on the project's simulated device backend.

Why the backend (``gpushare.gres.sim_backend.SimBackend``): it is the device interface the node agent reads
(memory, per-process memory, DCGM utilisation, power, the total-energy counter) with NVML's semantics,
so the numbers the policies see and the energy reported come from the same code the agent and the
epilog use, not from a second model. The simulator drives it like a workload would — a process per job
and GPU appears at dispatch with a CUDA context (``CONTEXT_GIB``), grows to its peak at its first kernel,
ends — on a virtual clock (the simulation's ``now``).

What stays here: Slurm's view (shards, exclusive holders), the job → process map, and a step history of
what the backend reported at each change, from which the 1 Hz telemetry window is sampled on demand
(with small seeded noise, so scores near a threshold jitter as a real DCGM series does) instead of
ticking every second. Aggregation and power are the backend's (``gpushare.gres.sim_timeline``): per-process
SMACT/SMOCC/DRAMA add up, capped at 1; power = idle + (max − idle)·min(1, ΣSMACT). Idle/max per model
below are datasheet TDPs and typical idle draws (an assumption where no datasheet gives idle).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from gpushare.gpus import GiB, MiB, GpuModel
from gpushare.gres.sim_backend import SimBackend

CONTEXT_GIB = 0.5
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
_NOISE_LEN = 8191  # prime, so GPU indices and seconds do not fall into step
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
    # step history of what the backend reported: time, used bytes, SMACT, SMOCC, DRAMA, power W
    history: list[tuple[float, int, float, float, float, float]] = field(default_factory=list)
    _times: list[float] = field(default_factory=list)

    @property
    def shards_total(self) -> int:
        return int(self.capacity_bytes // GiB)

    @property
    def shards_free(self) -> int:
        return self.shards_total - sum(r.shards for r in self.residents.values())

    def window(self, t: float, samples: int, seed: int) -> list[tuple[float, float, float]]:
        """The last ``samples`` 1 Hz samples (SMACT, SMOCC, DRAMA) up to ``t``, with seeded noise."""
        out, noise = [], _noise(seed)
        end = int(t)
        for second in range(end - samples + 1, end + 1):
            k = bisect.bisect_right(self._times, second) - 1
            if k < 0:
                out.append((0.0, 0.0, 0.0))
                continue
            a, o, d = self.history[k][2:5]
            if a > 0:
                n = (second * 3 + self.index * 7919) % _NOISE_LEN
                a = min(1.0, max(0.0, a + noise[n]))
                o = min(1.0, max(0.0, o + noise[n + 1]))
                d = min(1.0, max(0.0, d + noise[n + 2]))
            out.append((a, o, d))
        return out


class SimCluster:
    """N nodes × M GPUs of one model over one SimBackend; ``clock`` returns the simulation's time."""

    def __init__(self, model: GpuModel, capacity: int, nodes: int, per_node: int, clock: Callable[[], float]):
        idle, peak = POWER_W.get(model.name, (50.0, 300.0))
        count = nodes * per_node
        scenario = {"version": 1, "name": "gpushare-simulate", "gpus": [
            {"index": i, "model": model.name, "idle_power_w": idle, "max_power_w": peak} for i in range(count)]}
        self.backend = SimBackend.from_scenario(scenario, clock=clock)
        self.clock = clock
        self.model_name = model.name
        self.gpus = [SimGpu(i, i // per_node, capacity) for i in range(count)]
        self._next_pid = 1000

    def used_bytes(self, gpu: int) -> int:
        return int(self.backend.memory(gpu).used)

    def launch(self, gpu: int, job_id: str, mem_bytes: int, util: tuple[float, float, float], shards: int) -> None:
        """A job's process appears on ``gpu`` holding only its CUDA context."""
        self._next_pid += 1
        self.backend.start_process(gpu, self._next_pid, int(CONTEXT_GIB * GiB))
        self.gpus[gpu].residents[job_id] = Resident(job_id, self._next_pid, mem_bytes, util, shards)
        self.record(gpu)

    def first_kernel(self, gpu: int, job_id: str, mem_bytes: int | None = None) -> None:
        """The job's first kernel: memory grows to its peak (or ``mem_bytes``) and it starts loading the GPU."""
        resident = self.gpus[gpu].residents[job_id]
        smact, smocc, drama = resident.util
        held = resident.mem_bytes if mem_bytes is None else mem_bytes
        self.backend.update_process(resident.pid, memory_mib=held / MiB, smact=smact, smocc=smocc,
                                    drama=drama)
        resident.active = True
        self.record(gpu)

    def grow(self, gpu: int, job_id: str, mem_bytes: int) -> None:
        """A running job's memory changes (it outgrows its share)."""
        self.backend.update_process(self.gpus[gpu].residents[job_id].pid, memory_mib=mem_bytes / MiB)
        self.record(gpu)

    def end(self, gpu: int, job_id: str) -> None:
        resident = self.gpus[gpu].residents.pop(job_id)
        self.backend.end_process(resident.pid)
        self.gpus[gpu].exclusive = self.gpus[gpu].exclusive and bool(self.gpus[gpu].residents)
        self.record(gpu)

    def record(self, gpu: int) -> None:
        """Append what the backend reports now as a step (replacing a step at the same time)."""
        t = self.clock()
        util = self.backend.utilization(gpu)
        point = (t, self.used_bytes(gpu), float(util.smact), float(util.smocc), float(util.drama),
                 float(self.backend.power_watts(gpu)))
        sim_gpu = self.gpus[gpu]
        if sim_gpu.history and sim_gpu.history[-1][0] == t:
            sim_gpu.history[-1] = point
        else:
            sim_gpu.history.append(point)
            sim_gpu._times.append(t)

    def energy_j(self, gpu: int) -> float:
        """The backend's total-energy counter now, in joules (what the prolog/epilog read)."""
        return self.backend.energy_mj(gpu) / 1000.0
