"""Pure functions over a scenario's process timeline: who runs when, with what memory and activity,
and how much energy the GPU has used.

Why pure and closed-form: the energy counter must be exact and identical in every process that reads the
state file, whatever its sampling rate. Power is piecewise constant between timeline events (a process
starts, ends or changes step), so the energy is a finite sum over those segments — no accumulator that a
missed sample or a second reader could corrupt, and no sleeping in tests (docs/style.md #11).

Power model (documented, simple on purpose): ``idle_power_w + (max_power_w - idle_power_w) * min(1, Σ
SMACT)`` over the processes running on the GPU.
"""

from __future__ import annotations

from typing import Any


def active(proc: dict[str, Any], t: float) -> bool:
    """Is the process running at simulated time ``t`` (seconds since the state's epoch)?"""
    end = proc.get("end_s")
    return proc["start_s"] <= t and (end is None or t < end)


def values_at(proc: dict[str, Any], t: float) -> dict[str, float]:
    """Memory (MiB) and SMACT/SMOCC/DRAMA of a process at ``t``, after the steps it has reached."""
    out = {k: proc[k] for k in ("memory_mib", "smact", "smocc", "drama")}
    age = t - proc["start_s"]
    for step in proc.get("steps", ()):
        if step["after_s"] > age:
            break
        out.update({k: v for k, v in step.items() if k != "after_s"})
    return out


def running(processes: list[dict[str, Any]], gpu: int, t: float) -> list[dict[str, Any]]:
    return [p for p in processes if p["gpu"] == gpu and active(p, t)]


def activity(processes: list[dict[str, Any]], gpu: int, t: float) -> dict[str, float]:
    """GPU-wide SMACT/SMOCC/DRAMA at ``t``: per-process values summed and capped at 1."""
    total = {"smact": 0.0, "smocc": 0.0, "drama": 0.0}
    for proc in running(processes, gpu, t):
        vals = values_at(proc, t)
        for key in total:
            total[key] += vals[key]
    return {k: min(1.0, v) for k, v in total.items()}


def power_at(gpu: dict[str, Any], processes: list[dict[str, Any]], t: float) -> float:
    smact = activity(processes, gpu["index"], t)["smact"]
    return gpu["idle_power_w"] + (gpu["max_power_w"] - gpu["idle_power_w"]) * smact


def _breakpoints(processes: list[dict[str, Any]], gpu: int, t: float) -> list[float]:
    points = {0.0, t}
    for proc in processes:
        if proc["gpu"] != gpu:
            continue
        points.add(proc["start_s"])
        if proc.get("end_s") is not None:
            points.add(proc["end_s"])
        for step in proc.get("steps", ()):
            points.add(proc["start_s"] + step["after_s"])
    return sorted(p for p in points if 0.0 <= p <= t)


def energy_mj(gpu: dict[str, Any], processes: list[dict[str, Any]], t: float) -> int:
    """Total energy counter at ``t`` in millijoules: start value + ∫ power dt from the epoch."""
    joules = 0.0
    points = _breakpoints(processes, gpu["index"], max(0.0, t))
    for a, b in zip(points, points[1:]):
        joules += power_at(gpu, processes, a) * (b - a)  # constant on [a, b)
    return int(gpu["energy_start_mj"] + round(joules * 1000.0))
