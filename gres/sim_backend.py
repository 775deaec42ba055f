"""The simulated backend: GPUs from the catalogue, behaviour from a scenario, NVML's semantics and codes.

Why: the agent, the MIG executor and the trace simulator must be testable — and demonstrable on a Slurm
test cluster — without a GPU, and the fake must fail the way the driver does or the tests prove nothing
(docs/style.md #3). Models, memory, MIG profiles, ids and placements come from ``gpushare.gpus`` (never copied);
the timeline, power and knobs from the scenario (``gpushare.gres.sim_scenario``); MIG rules from ``gpushare.gres.sim_mig``;
energy from ``gpushare.gres.sim_timeline``. State lives in memory or in a shared JSON file (``gpushare.gres.sim_state``).

Time is ``clock() - epoch`` with ``clock`` injected (docs/style.md #11): tests pass a fake clock and advance it;
separate processes sharing a state file use the default wall clock so they agree on "now".

CLI: ``python -m gpushare.gres.sim_backend init SCENARIO.toml STATE.json [--force]`` writes a fresh state file.
"""

from __future__ import annotations

import argparse
import time
import uuid as uuidlib
from pathlib import Path
from typing import Any, Callable

from gpushare.gpus import BUILTIN_GPUS, GpuModel, MiB
from gpushare.gres import sim_mig, sim_timeline as tl
from gpushare.gres.device import (ComputeInstance, GiProfile, GpuInfo, GpuInstance, MemoryInfo, MigDevice, Placement,
                         ProcessInfo, ProcessUtil, Utilization, ci_cap_minor, gi_cap_minor)
from gpushare.gres import sim_memlimits
from gpushare.gres.errors import GpuError, NvmlCode
from gpushare.gres.memlimits import LIMIT_MAX, MemoryLimit
from gpushare.gres.mps import SimMps
from gpushare.gres.na import NA, NaType
from gpushare.gres.sim_control import SimControl, alive
from gpushare.gres.sim_scenario import load_scenario, validate_scenario
from gpushare.gres.sim_state import FileStore, MemoryStore

_NS = uuidlib.UUID("6f1c9a52-7d1e-4c55-9a43-51a2d6b0c0de")
_NOT_SUPPORTED = object()  # internal marker: the metric reads as NA


def _gpu_uuid(scenario_name: str, index: int, model: str) -> str:
    return "GPU-" + str(uuidlib.uuid5(_NS, f"{scenario_name}/{index}/{model}"))


def _mig_uuid(gpu_uuid: str, gi_id: int, ci_id: int) -> str:
    return "MIG-" + str(uuidlib.uuid5(_NS, f"{gpu_uuid}/{gi_id}/{ci_id}"))


def initial_state(scenario: dict[str, Any], epoch: float) -> dict[str, Any]:
    """A state dict from a validated scenario: UUIDs filled in, no instances, no MPS daemons."""
    state = {"epoch": epoch, "name": scenario["name"], "gpus": [], "processes": list(scenario["processes"]),
             "mps": {}}
    for gpu in scenario["gpus"]:
        gpu = dict(gpu)
        gpu["uuid"] = gpu["uuid"] or _gpu_uuid(scenario["name"], gpu["index"], gpu["model"])
        state["gpus"].append(gpu)
    return state


class SimBackend(SimControl):
    """:class:`gpushare.gres.device.GpuBackend` over a simulated state. Extra sim-only methods are marked."""

    name = "sim"

    def __init__(self, store: FileStore | MemoryStore, clock: Callable[[], float] = time.time,
                 catalogue: dict[str, GpuModel] | None = None) -> None:
        self.store = store
        self.clock = clock
        self.catalogue = BUILTIN_GPUS if catalogue is None else catalogue

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_scenario(cls, scenario: dict[str, Any] | str | Path, state_path: str | Path | None = None,
                      clock: Callable[[], float] = time.time, overwrite: bool = False) -> "SimBackend":
        """Start a simulation: in memory, or written to ``state_path`` for other processes to open."""
        valid: dict[str, Any] = (load_scenario(scenario) if isinstance(scenario, (str, Path))
                                 else validate_scenario(scenario))
        state = initial_state(valid, clock())
        if state_path is None:
            return cls(MemoryStore(state), clock)
        store = FileStore(state_path)
        store.create(state, overwrite=overwrite)
        return cls(store, clock)

    @classmethod
    def open(cls, state_path: str | Path, clock: Callable[[], float] = time.time) -> "SimBackend":
        """Attach to a state file another process created."""
        store = FileStore(state_path)
        store.read()  # fail now, with a clear message, if it is missing or corrupt
        return cls(store, clock)

    # -- helpers -----------------------------------------------------------------------------------
    def now(self) -> float:
        """Simulated seconds since the state was created (sim-only)."""
        return self.clock() - self.store.read()["epoch"]

    def _t(self, state: dict[str, Any]) -> float:
        return self.clock() - state["epoch"]

    @staticmethod
    def _gpu(state: dict[str, Any], index: int) -> dict[str, Any]:
        for gpu in state["gpus"]:
            if gpu["index"] == index:
                return gpu
        raise GpuError(NvmlCode.INVALID_ARGUMENT, f"no GPU with index {index} (have {len(state['gpus'])})")

    def _check(self, state: dict[str, Any], gpu: dict[str, Any], metric: str | None) -> object:
        """Raise the fault a real GPU would report; return _NOT_SUPPORTED when the metric reads NA."""
        lost = gpu.get("lost_at_s")
        if lost is not None and self._t(state) >= lost:
            raise GpuError(NvmlCode.GPU_IS_LOST, f"GPU {gpu['index']} ({gpu['uuid']}) has fallen off the bus")
        code = gpu["errors"].get(metric) if metric else None
        if code == "NOT_SUPPORTED":
            return _NOT_SUPPORTED
        if code:
            raise GpuError(code, f"{metric} on GPU {gpu['index']}")
        return None

    def _read(self, index: int, metric: str | None) -> tuple[dict, dict, float, bool]:
        state = self.store.read()
        if any(p.get("host") for p in state["processes"]) and self._dead_host_process(state):
            with self.store.transaction() as fresh:
                self._reap_dead_host_processes(fresh)
            state = self.store.read()
        gpu = self._gpu(state, index)
        na = self._check(state, gpu, metric) is _NOT_SUPPORTED
        return state, gpu, self._t(state), na

    def _dead_host_process(self, state: dict[str, Any]) -> bool:
        t = self._t(state)
        return any(p.get("host") and tl.active(p, t) and not alive(int(p["pid"])) for p in state["processes"])

    def _model(self, gpu: dict[str, Any]) -> GpuModel:
        return self.catalogue[gpu["model"]]

    # -- inventory ---------------------------------------------------------------------------------
    def gpu_count(self) -> int:
        return len(self.store.read()["gpus"])

    def gpu(self, index: int) -> GpuInfo:
        state, g, _, _ = self._read(index, None)
        mig = (g["mig_current"], g["mig_pending"]) if g["mig_capable"] else (NA, NA)
        return GpuInfo(g["index"], g["uuid"], g["name"], g["model"], g["total_bytes"], g["minor"], *mig)

    def gpus(self) -> list[GpuInfo]:
        return [self.gpu(g["index"]) for g in self.store.read()["gpus"]]

    # -- telemetry ---------------------------------------------------------------------------------
    def memory(self, index: int) -> MemoryInfo:
        state, g, t, na = self._read(index, "memory")
        if na:
            return MemoryInfo(g["total_bytes"], NA, NA)
        used = sum(int(tl.values_at(p, t)["memory_mib"] * MiB) for p in tl.running(state["processes"], index, t))
        used = min(used, g["total_bytes"])
        return MemoryInfo(g["total_bytes"], used, g["total_bytes"] - used)

    def processes(self, index: int) -> list[ProcessInfo]:
        state, g, t, na = self._read(index, "processes")
        out = []
        for p in tl.running(state["processes"], index, t):
            used = NA if na else int(tl.values_at(p, t)["memory_mib"] * MiB)
            gi = p.get("gi")
            out.append(ProcessInfo(p["pid"], used, gi, None if gi is None else 0))
        return out

    def utilization(self, index: int) -> Utilization:
        state, g, t, na = self._read(index, "utilization")
        source = g["utilization_source"]
        if na:
            return Utilization(source, NA, NA, NA, NA, NA)
        act = tl.activity(state["processes"], index, t)
        busy = 1.0 if act["smact"] > 0 else 0.0  # NVML "gpu": time any kernel ran, coarse by design
        if source == "nvml":
            return Utilization("nvml", NA, NA, NA, busy, act["drama"])
        return Utilization("dcgm", act["smact"], act["smocc"], act["drama"], busy, act["drama"])

    def process_utilization(self, index: int, since_us: int = 0) -> list[ProcessUtil] | NaType:
        """Processes running kernels now (their SMACT > 0), stamped with the simulated time.

        NA when the scenario makes per-process utilisation unsupported (``errors`` of metric
        ``process_utilization``, or a GPU whose ``utilization`` is NA), as on GPUs NVML cannot sample.
        """
        state, g, t, na = self._read(index, "process_utilization")
        if na:
            return NA
        stamp = int(t * 1e6)
        if stamp <= since_us:
            return []
        return [ProcessUtil(p["pid"], float(tl.values_at(p, t)["smact"]), stamp)
                for p in tl.running(state["processes"], index, t) if tl.values_at(p, t)["smact"] > 0]

    def power_watts(self, index: int) -> float:
        state, g, t, na = self._read(index, "power")
        return NA if na else tl.power_at(g, state["processes"], t)

    def energy_mj(self, index: int) -> int | NaType:  # the device interface's Number
        state, g, t, na = self._read(index, "energy")
        return NA if na else tl.energy_mj(g, state["processes"], t)

    # -- MIG mode ----------------------------------------------------------------------------------
    def _busy(self, state: dict[str, Any], index: int) -> list[dict[str, Any]]:
        return tl.running(state["processes"], index, self._t(state))

    def set_mig_mode(self, index: int, enabled: bool) -> bool:
        with self.store.transaction() as state:
            g = self._gpu(state, index)
            self._check(state, g, "mig")
            if not g["mig_capable"] or g["errors"].get("mig") == "NOT_SUPPORTED":
                raise GpuError(NvmlCode.NOT_SUPPORTED, f"GPU {index} ({g['name']}) does not support MIG")
            if self._busy(state, index):
                raise GpuError(NvmlCode.IN_USE, f"set MIG mode on GPU {index}: compute processes are running")
            if not enabled and g["gpu_instances"]:
                raise GpuError(NvmlCode.IN_USE, f"disable MIG on GPU {index}: GPU instances still exist")
            g["mig_pending"] = bool(enabled)
            if not g["mode_change_needs_reset"] and not g["driver_busy"]:
                g["mig_current"] = g["mig_pending"]
            return g["mig_current"] == g["mig_pending"]

    def reset_gpu(self, index: int) -> None:
        """Apply a pending MIG mode; like ``nvidia-smi -r``, refused while anything holds the GPU."""
        with self.store.transaction() as state:
            g = self._gpu(state, index)
            self._check(state, g, None)
            if self._busy(state, index) or g["driver_busy"]:
                raise GpuError(NvmlCode.IN_USE, f"reset GPU {index}: processes or NVML clients hold it")
            g["mig_current"] = g["mig_pending"]
            g["gpu_instances"] = []  # MIG instances do not survive a reset

    # -- MIG instances -----------------------------------------------------------------------------
    def gi_profiles(self, index: int) -> list[GiProfile]:
        _, g, _, _ = self._read(index, "mig")
        sim_mig.require_mig(g, "list GPU-instance profiles")
        return [GiProfile(p.gi_profile_id, p.name, p.compute_slices, p.usable_bytes, p.max_count,
                          tuple(Placement(s, p.memory_slices) for s in p.placements))
                for p in self._model(g).mig_profiles]

    @staticmethod
    def _gi_record(index: int, gi: dict[str, Any]) -> GpuInstance:
        return GpuInstance(index, gi["id"], gi["profile_id"], gi["profile_name"], Placement(gi["start"], gi["size"]))

    def create_gpu_instance(self, index: int, profile_id: int, start: int) -> GpuInstance:
        with self.store.transaction() as state:
            g = self._gpu(state, index)
            self._check(state, g, "mig")
            return self._gi_record(index, sim_mig.create_gi(g, self._model(g), profile_id, start))

    def create_compute_instance(self, index: int, gi_id: int) -> ComputeInstance:
        with self.store.transaction() as state:
            g = self._gpu(state, index)
            self._check(state, g, "mig")
            gi, ci = sim_mig.create_ci(g, gi_id)
            return ComputeInstance(index, gi_id, ci, sim_mig.CI_PROFILE_BY_SLICES[gi["compute_slices"]],
                                   gi["compute_slices"])

    def gpu_instances(self, index: int) -> list[GpuInstance]:
        _, g, _, _ = self._read(index, "mig")
        sim_mig.require_mig(g, "list GPU instances")
        return [self._gi_record(index, gi) for gi in g["gpu_instances"]]

    def compute_instances(self, index: int, gi_id: int) -> list[ComputeInstance]:
        _, g, _, _ = self._read(index, "mig")
        sim_mig.require_mig(g, "list compute instances")
        gi = sim_mig.find_gi(g, gi_id)
        return [ComputeInstance(index, gi_id, ci, sim_mig.CI_PROFILE_BY_SLICES[gi["compute_slices"]],
                                gi["compute_slices"]) for ci in gi["cis"]]

    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None:
        with self.store.transaction() as state:
            g = self._gpu(state, index)
            self._check(state, g, "mig")
            busy = {p["gi"] for p in self._busy(state, index) if p.get("gi") is not None}
            sim_mig.destroy_ci(g, gi_id, ci_id, busy)

    def destroy_gpu_instance(self, index: int, gi_id: int) -> None:
        with self.store.transaction() as state:
            g = self._gpu(state, index)
            self._check(state, g, "mig")
            sim_mig.destroy_gi(g, gi_id)

    def mig_devices(self, index: int) -> list[MigDevice]:
        _, g, _, _ = self._read(index, "mig")
        if not g["mig_capable"] or not g["mig_current"]:
            return []
        return [MigDevice(index, g["minor"], gi["id"], ci, _mig_uuid(g["uuid"], gi["id"], ci), gi["profile_name"],
                          gi["memory_bytes"], gi_cap_minor(g["minor"], gi["id"]),
                          ci_cap_minor(g["minor"], gi["id"], ci))
                for gi in g["gpu_instances"] for ci in gi["cis"]]

    # -- MPS ---------------------------------------------------------------------------------------
    def mps(self, run_dir: str) -> SimMps:
        return SimMps(self, run_dir)

    # -- per-cgroup memory limits (semantics in gpushare.gres.sim_memlimits) ---------------------------
    def set_memory_limit(self, index: int, cgroup: str, hard_bytes: int, soft_bytes: int = 0) -> None:
        with self.store.transaction() as state:
            g = self._gpu(state, index)
            self._check(state, g, None)
            sim_memlimits.set_limit(g, state["processes"], self._t(state), cgroup, hard_bytes, soft_bytes)

    def clear_memory_limit(self, index: int, cgroup: str) -> None:
        self.set_memory_limit(index, cgroup, LIMIT_MAX, 0)

    def memory_limit(self, index: int, cgroup: str) -> MemoryLimit:
        state, g, t, _ = self._read(index, None)
        return sim_memlimits.get_limit(g, state["processes"], t, cgroup)

    def allocate(self, index: int, pid: int, nbytes: int, cgroup: str | None = None, managed: bool = False) -> int:
        """Sim-only: process ``pid`` (in ``cgroup``) allocates ``nbytes`` of device (or ``managed``) memory now;
        returns the CUDA result (0, or 2 = ``CUDA_ERROR_OUT_OF_MEMORY``) and charges it on success."""
        with self.store.transaction() as state:
            g = self._gpu(state, index)
            self._check(state, g, None)
            t = self._t(state)
            result = sim_memlimits.allocate(g, state["processes"], t, cgroup, nbytes, managed)
            if result != sim_memlimits.CUDA_SUCCESS:
                return result
            mib = nbytes / MiB
            for proc in tl.running(state["processes"], index, t):
                if proc["pid"] == pid:
                    now = tl.values_at(proc, t)["memory_mib"]
                    proc["steps"].append({"after_s": t - proc["start_s"], "memory_mib": now + mib})
                    break
            else:
                proc = {"pid": pid, "gpu": index, "start_s": t, "end_s": None, "memory_mib": mib, "smact": 0.0,
                        "smocc": 0.0, "drama": 0.0, "gi": None, "steps": [], **({"cgroup": cgroup} if cgroup else {})}
                state["processes"].append(proc)
            if managed:
                proc["managed_mib"] = proc.get("managed_mib", 0.0) + mib
            return result

    def mem_get_info(self, index: int, cgroup: str | None = None) -> tuple[int, int]:
        """Sim-only: (free, total) as ``cuMemGetInfo`` reports them to a process in ``cgroup``."""
        state, g, t, _ = self._read(index, None)
        return sim_memlimits.mem_get_info(g, state["processes"], t, cgroup)

    def close(self) -> None:
        """Nothing to release: every call reads or writes the store directly."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpushare.gres.sim_backend", description="Simulated GPU state files.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    init = sub.add_parser("init", help="write a fresh state file from a scenario")
    init.add_argument("scenario")
    init.add_argument("state")
    init.add_argument("--force", action="store_true", help="replace an existing state file")
    args = parser.parse_args(argv)
    try:
        SimBackend.from_scenario(args.scenario, args.state, overwrite=args.force)
    except (ValueError, FileExistsError) as exc:
        parser.exit(2, f"error: {exc}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
