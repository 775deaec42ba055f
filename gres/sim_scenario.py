"""Scenario files for the simulated backend: load, validate strictly, normalise.

Why strict (docs/style.md #5): a scenario drives integration tests and simulator runs; a misspelt key that is
silently ignored (``lost_at`` for ``lost_at_s``) would make a test pass for the wrong reason. Every error is
one line naming the file and the key path, e.g. ``s.toml: gpus[1].modle: unknown key (known: …)``.

The normalised scenario is a plain JSON-able dict; it is also the static half of the state file
(``gpushare.gres.sim_state``), so every process that opens the state sees the same GPUs and timeline.
Format: see ``docs/device-interface.md`` ("Scenario file").
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from gpushare.errors import GpushareError
from gpushare.gpus import BUILTIN_GPUS, GpuModel
from gpushare.gres.errors import NvmlCode

SCENARIO_VERSION = 1
METRICS = ("memory", "processes", "utilization", "power", "energy", "mig", "process_utilization")
UTIL_FIELDS = ("smact", "smocc", "drama")
MEMORY_LIMIT_MODES = ("absent", "off", "dmem", "misc")  # what the driver offers: gpushare.gres.sim_memlimits

_TOP = {"version": True, "name": False, "gpus": True, "processes": False}
_GPU = {
    "index": False, "model": True, "uuid": False, "minor": False, "mig_capable": False, "mig_mode": False,
    "mode_change_needs_reset": False, "driver_busy": False, "idle_power_w": False, "max_power_w": False,
    "energy_start_mj": False, "lost_at_s": False, "utilization_source": False, "unsupported": False,
    "errors": False, "memory_limits": False,
}
_PROC = {"pid": True, "gpu": True, "start_s": False, "end_s": False, "memory_mib": True, "smact": False,
         "smocc": False, "drama": False, "gi": False, "steps": False}
_STEP = {"after_s": True, "memory_mib": False, "smact": False, "smocc": False, "drama": False}


class ScenarioError(GpushareError, ValueError):
    """A scenario that cannot be used; the message is one line naming the bad key."""


def _keys(obj: Any, spec: dict[str, bool], where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ScenarioError(f"{where}: expected a table/object, got {type(obj).__name__}")
    for key in obj:
        if key not in spec:
            raise ScenarioError(f"{where}.{key}: unknown key (known: {', '.join(spec)})")
    for key, required in spec.items():
        if required and key not in obj:
            raise ScenarioError(f"{where}.{key}: required key missing")
    return obj


def _num(obj: dict, key: str, where: str, default: float | None, lo: float = 0.0, hi: float | None = None,
         integer: bool = False) -> Any:
    value = obj.get(key, default)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        kind = "an integer" if integer else "a number"
        raise ScenarioError(f"{where}.{key}: expected {kind}, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise ScenarioError(f"{where}.{key}: {value!r} must be {bound}")
    return value


def _bool(obj: dict, key: str, where: str, default: bool) -> bool:
    value = obj.get(key, default)
    if not isinstance(value, bool):
        raise ScenarioError(f"{where}.{key}: expected true or false, got {value!r}")
    return value


def _gpu(raw: Any, pos: int, catalogue: dict[str, GpuModel]) -> dict[str, Any]:
    where = f"gpus[{pos}]"
    g = _keys(raw, _GPU, where)
    model_key = str(g["model"]).lower()
    if model_key not in catalogue:
        raise ScenarioError(f"{where}.model: unknown GPU {g['model']!r} (known: {', '.join(sorted(catalogue))})")
    model = catalogue[model_key]
    capable = _bool(g, "mig_capable", where, model.mig_capable)
    if capable and not model.mig_capable:
        raise ScenarioError(f"{where}.mig_capable: {model_key} has no MIG profiles in the GPU catalogue")
    mig_mode = _bool(g, "mig_mode", where, False)
    if mig_mode and not capable:
        raise ScenarioError(f"{where}.mig_mode: GPU is not MIG capable")
    idle = _num(g, "idle_power_w", where, 60.0)
    peak = _num(g, "max_power_w", where, 400.0)
    if peak < idle:
        raise ScenarioError(f"{where}.max_power_w: {peak} is below idle_power_w {idle}")
    source = g.get("utilization_source", "dcgm")
    if source not in ("dcgm", "nvml"):
        raise ScenarioError(f"{where}.utilization_source: {source!r} must be 'dcgm' or 'nvml'")
    unsupported = g.get("unsupported", [])
    errors = g.get("errors", {})
    if not isinstance(unsupported, list) or not isinstance(errors, dict):
        raise ScenarioError(f"{where}.unsupported/errors: expected a list and a table")
    injected: dict[str, str] = {m: "NOT_SUPPORTED" for m in unsupported}
    for metric, code in errors.items():
        try:
            injected[metric] = NvmlCode.parse(code).name
        except ValueError as exc:
            raise ScenarioError(f"{where}.errors.{metric}: {exc}") from None
    for metric in injected:
        if metric not in METRICS:
            raise ScenarioError(f"{where}.errors: unknown metric {metric!r} (known: {', '.join(METRICS)})")
    limits = g.get("memory_limits", "absent")
    if limits not in MEMORY_LIMIT_MODES:
        raise ScenarioError(f"{where}.memory_limits: {limits!r} must be one of {', '.join(MEMORY_LIMIT_MODES)}")
    index = _num(g, "index", where, pos, integer=True)
    return {
        "index": index, "model": model_key, "name": model.marketing_name, "total_bytes": model.total_bytes,
        "uuid": g.get("uuid"), "minor": _num(g, "minor", where, index, integer=True),
        "mig_capable": capable, "mig_current": mig_mode, "mig_pending": mig_mode,
        "mode_change_needs_reset": _bool(g, "mode_change_needs_reset", where, True),
        "driver_busy": _bool(g, "driver_busy", where, False), "idle_power_w": float(idle),
        "max_power_w": float(peak), "energy_start_mj": _num(g, "energy_start_mj", where, 0, integer=True),
        "lost_at_s": _num(g, "lost_at_s", where, None), "utilization_source": source, "errors": injected,
        "gpu_instances": [], "memory_limits": limits, "cgroup_limits": {},
    }


def _util(obj: dict, where: str, defaults: dict[str, float]) -> dict[str, float]:
    return {f: float(_num(obj, f, where, defaults.get(f), 0.0, 1.0)) for f in UTIL_FIELDS if
            obj.get(f, defaults.get(f)) is not None}


def _process(raw: Any, pos: int, gpu_indices: set[int]) -> dict[str, Any]:
    where = f"processes[{pos}]"
    p = _keys(raw, _PROC, where)
    pid = _num(p, "pid", where, None, lo=1, integer=True)
    gpu = _num(p, "gpu", where, None, integer=True)
    if gpu not in gpu_indices:
        raise ScenarioError(f"{where}.gpu: no GPU with index {gpu} (have {sorted(gpu_indices)})")
    start = float(_num(p, "start_s", where, 0.0))
    end = _num(p, "end_s", where, None)
    if end is not None and end <= start:
        raise ScenarioError(f"{where}.end_s: {end} must be after start_s {start}")
    steps = []
    for k, step in enumerate(p.get("steps", [])):
        swhere = f"{where}.steps[{k}]"
        s = _keys(step, _STEP, swhere)
        entry: dict[str, Any] = {"after_s": float(_num(s, "after_s", swhere, None))}
        if "memory_mib" in s:
            entry["memory_mib"] = float(_num(s, "memory_mib", swhere, None))
        entry.update(_util(s, swhere, {}))
        steps.append(entry)
    if any(a["after_s"] > b["after_s"] for a, b in zip(steps, steps[1:])):
        raise ScenarioError(f"{where}.steps: after_s values must be in increasing order")
    base = {"smact": 0.0, "smocc": 0.0, "drama": 0.0}
    return {"pid": pid, "gpu": gpu, "start_s": start, "end_s": None if end is None else float(end),
            "memory_mib": float(_num(p, "memory_mib", where, None)), **_util(p, where, base),
            "gi": _num(p, "gi", where, None, integer=True), "steps": steps}


def validate_scenario(raw: Any, catalogue: dict[str, GpuModel] | None = None) -> dict[str, Any]:
    """Check a parsed scenario and return its normalised form (defaults filled in)."""
    table = BUILTIN_GPUS if catalogue is None else catalogue
    top = _keys(raw, _TOP, "scenario")
    if top["version"] != SCENARIO_VERSION:
        raise ScenarioError(f"scenario.version: {top['version']!r} is not supported (expected {SCENARIO_VERSION})")
    if not isinstance(top["gpus"], list) or not top["gpus"]:
        raise ScenarioError("scenario.gpus: expected a non-empty list of GPUs")
    gpus = [_gpu(g, i, table) for i, g in enumerate(top["gpus"])]
    indices = [g["index"] for g in gpus]
    if len(set(indices)) != len(indices):
        raise ScenarioError(f"scenario.gpus: duplicate index in {indices}")
    processes = [_process(p, i, set(indices)) for i, p in enumerate(top.get("processes", []))]
    pids = [p["pid"] for p in processes]
    if len(set(pids)) != len(pids):
        raise ScenarioError(f"scenario.processes: duplicate pid in {pids}")
    return {"version": SCENARIO_VERSION, "name": str(top.get("name", "sim")), "gpus": gpus,
            "processes": processes}


def load_scenario(path: str | Path, catalogue: dict[str, GpuModel] | None = None) -> dict[str, Any]:
    """Read a ``.toml`` or ``.json`` scenario file; errors name the file and the key."""
    path = Path(path)
    try:
        text = path.read_text()
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (OSError, ValueError) as exc:
        raise ScenarioError(f"{path}: cannot read scenario: {exc}") from exc
    try:
        return validate_scenario(raw, catalogue)
    except ScenarioError as exc:
        raise ScenarioError(f"{path}: {exc}") from None
