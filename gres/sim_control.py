"""Scenario control for the simulated backend: make processes appear, change and end, flip knobs and
inject NVML errors while a simulation runs.

Why separate from the backend proper: these calls are not part of the device interface (a real GPU has no
``start_process``); the trace simulator and tests use them to drive what the interface then reports.
Every change is a timeline entry stamped with the simulated time, so the energy counter stays an exact
integral (``gpushare.gres.sim_timeline``). Mixed into :class:`gpushare.gres.sim_backend.SimBackend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpushare.gpus import MiB
from gpushare.gres import sim_timeline as tl
from gpushare.gres.errors import GpuError, NvmlCode
from gpushare.gres.sim_scenario import METRICS


class SimControl:
    """Sim-only methods; expects ``store``, ``_gpu``, ``_check`` and ``_t`` from SimBackend."""

    store: Any

    if TYPE_CHECKING:  # SimBackend's, declared here so the mixin type-checks; absent at run time (no MRO change)
        def _t(self, state: dict[str, Any]) -> float: ...

        @staticmethod
        def _gpu(state: dict[str, Any], index: int) -> dict[str, Any]: ...

        def _check(self, state: dict[str, Any], gpu: dict[str, Any], metric: str | None) -> object: ...

    def start_process(self, index: int, pid: int, memory_bytes: int, smact: float = 0.0, smocc: float = 0.0,
                      drama: float = 0.0, gi: int | None = None, host: bool = False) -> None:
        """A process appears on a GPU now (the trace simulator launching a job). ``host``: ``pid`` is a real
        process of this machine, and the GPU forgets it once that process is gone, killed or not, as the
        driver frees a dead process's context."""
        with self.store.transaction() as state:
            g = self._gpu(state, index)
            self._check(state, g, None)
            t = self._t(state)
            if gi is not None:  # a process can only run in an existing instance that has a compute instance
                from gpushare.gres.sim_mig import find_gi, require_mig

                require_mig(g, f"start pid {pid} in GI {gi}")
                if not find_gi(g, gi)["cis"]:
                    raise GpuError(NvmlCode.NOT_FOUND, f"GI {gi} on GPU {index} has no compute instance")
            if any(p["pid"] == pid and tl.active(p, t) for p in state["processes"]):
                raise GpuError(NvmlCode.INVALID_ARGUMENT, f"pid {pid} is already running")
            state["processes"].append({"pid": pid, "gpu": index, "start_s": t, "end_s": None,
                                       "memory_mib": memory_bytes / MiB, "smact": smact, "smocc": smocc,
                                       "drama": drama, "gi": gi, "steps": [], **({"host": True} if host else {})})

    def update_process(self, pid: int, **values: float) -> None:
        """Change a running process's memory_mib/smact/smocc/drama from now on."""
        bad = set(values) - {"memory_mib", "smact", "smocc", "drama"}
        if bad:
            raise GpuError(NvmlCode.INVALID_ARGUMENT, f"update_process: unknown fields {sorted(bad)}")
        with self.store.transaction() as state:
            proc = self._running_proc(state, pid)
            proc["steps"].append({"after_s": self._t(state) - proc["start_s"], **values})

    def _reap_dead_host_processes(self, state: dict[str, Any]) -> bool:
        """End host processes that no longer exist (in ``state``, inside a transaction); True if any ended."""
        t, ended = self._t(state), False
        for proc in state["processes"]:
            if proc.get("host") and tl.active(proc, t) and not alive(int(proc["pid"])):
                proc["end_s"], ended = t, True
        return ended

    def end_process(self, pid: int) -> None:
        with self.store.transaction() as state:
            self._running_proc(state, pid)["end_s"] = self._t(state)

    def _running_proc(self, state: dict[str, Any], pid: int) -> dict[str, Any]:
        t = self._t(state)
        for proc in state["processes"]:
            if proc["pid"] == pid and tl.active(proc, t):
                return proc
        raise GpuError(NvmlCode.NOT_FOUND, f"no running process with pid {pid}")

    def set_knobs(self, index: int, **knobs: Any) -> None:
        """Flip ``driver_busy``, ``mode_change_needs_reset`` or ``lost_at_s`` (seconds; None = healthy)."""
        allowed = {"driver_busy", "mode_change_needs_reset", "lost_at_s"}
        if set(knobs) - allowed:
            raise GpuError(NvmlCode.INVALID_ARGUMENT, f"set_knobs: unknown {sorted(set(knobs) - allowed)}")
        with self.store.transaction() as state:
            self._gpu(state, index).update(knobs)

    def inject_error(self, index: int, metric: str, code: str | NvmlCode | None) -> None:
        """Make ``metric`` fail with an NVML code from now on (None clears it)."""
        if metric not in METRICS:
            raise GpuError(NvmlCode.INVALID_ARGUMENT, f"unknown metric {metric!r} (known: {', '.join(METRICS)})")
        with self.store.transaction() as state:
            errors = self._gpu(state, index)["errors"]
            if code is None:
                errors.pop(metric, None)
            else:
                errors[metric] = NvmlCode.parse(code).name


def alive(pid: int) -> bool:
    """Whether a process of this machine exists (a zombie counts until reaped)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True
