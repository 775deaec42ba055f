"""Metrics of a finished simulation, as CARMA §3.1 defines them, plus text and JSON renderings.

Makespan: first submission to last completion. JCT: submission to completion; waiting: time in a queue
(all attempts); execution: time on GPUs (all attempts, a crashed one included), so wait + exec = JCT.
Energy: the simulated backend's total-energy counters, every GPU (idle ones included), read at the first
arrival and at the last completion, as CARMA §3.1 does; ``energy_sublinear_mj`` is the same integral under
a sublinear power curve (see ``_sublinear_energy``). Utilisation and memory are time averages over the
makespan across GPUs.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from typing import Any, TextIO

from gpushare.gpus import GiB


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _time_average(history: list[tuple], column: int, start: float, end: float) -> float:
    """Time-weighted mean of a step series over [start, end]."""
    if end <= start:
        return math.nan
    total = 0.0
    for k, point in enumerate(history):
        lo = max(point[0], start)
        hi = min(history[k + 1][0] if k + 1 < len(history) else end, end)
        if hi > lo:
            total += point[column] * (hi - lo)
    return total / (end - start)


SUBLINEAR_EXPONENT = 0.7


def _sublinear_energy(sim: Any, gpu: Any, start: float, end: float) -> float:
    """Energy if power were idle + (max − idle)·SMACT^0.7 (sublinear, as CARMA §3.5 observes).

    A sensitivity figure beside the backend's linear counter: under a linear model collocation can only
    save idle power; measured GPUs draw less than proportionally more power at higher load.
    """
    lo, hi = sim.cluster.power_w
    history = [(t, lo + (hi - lo) * min(1.0, a) ** SUBLINEAR_EXPONENT) for t, _, a, *_ in gpu.history]
    return _time_average([(t, 0, p) for t, p in history], 2, start, end) * (end - start) if end > start else 0.0


def summarise(sim: Any) -> dict[str, Any]:
    """The summary dict of a run (also the ``--json`` document, under "summary")."""
    jobs = list(sim.jobs.values())
    done = [j for j in jobs if j.state == "done"]
    start = min((j.spec.submit_s for j in jobs), default=0.0)
    end = max((j.end for j in jobs if j.end is not None), default=start)
    jct = [j.end - j.spec.submit_s for j in done]
    wait = [j.wait_s for j in done]
    execution = [j.exec_s for j in done]
    energy = sum(sim.energy_j)  # counter deltas, first arrival to last event (the makespan's end)
    cfg = sim.config
    return {
        "policy": cfg.policy, "estimator": cfg.estimator, "seed": cfg.seed, "gpu": cfg.gpu,
        "nodes": cfg.nodes, "gpus_per_node": cfg.gpus_per_node, "recovery": cfg.recovery,
        "jobs": len(jobs), "completed": len(done), "failed": sum(j.state == "failed" for j in jobs),
        "makespan_s": end - start,
        "jct_mean_s": _mean(jct), "jct_p95_s": _pct(jct, 0.95),
        "wait_mean_s": _mean(wait), "wait_p95_s": _pct(wait, 0.95),
        "exec_mean_s": _mean(execution), "exec_p95_s": _pct(execution, 0.95),
        "ooms": sum(j.ooms for j in jobs),
        "neighbour_ooms": sum(j.neighbour_ooms for j in jobs), "caps": cfg.caps,
        "recoveries": sum(1 for j in done if j.recovered),
        "energy_mj": energy / 1e6,
        "energy_sublinear_mj": sum(_sublinear_energy(sim, g, start, end) for g in sim.gpus) / 1e6,
        "gpu_util_mean": _mean([_time_average(g.history, 2, start, end) for g in sim.gpus]),
        "gpu_mem_mean_gib": _mean([_time_average(g.history, 1, start, end) / GiB for g in sim.gpus]),
        "interference_fallback_pairs": len(sim.interference.fallback_pairs),
        "interference_measured": sim.interference.measured,
        "live": cfg.live.describe() if cfg.live else None,
    }


def job_records(sim: Any) -> list[dict[str, Any]]:
    return list(_job_rows(sim))


def _job_rows(sim: Any) -> Iterator[dict[str, Any]]:
    return ({
        "job_id": j.spec.job_id, "model": j.spec.model, "batch": j.spec.batch, "gpus": j.spec.gpus,
        "mem_gib": j.spec.mem_gib, "request_gib": None if j.request is None else j.request / GiB,
        "submit_s": j.spec.submit_s, "start_s": j.first_start, "end_s": j.end, "state": j.state,
        "placed_on": j.gpus, "wait_s": j.wait_s, "exec_s": j.exec_s, "ooms": j.ooms,
        "neighbour_ooms": j.neighbour_ooms, "recovered": j.recovered,
        "ttfk_s": j.spec.ttfk_s, "reason": j.reason or None,
    } for j in sorted(sim.jobs.values(), key=lambda j: j.spec.job_id))


def gpu_timelines(sim: Any) -> list[dict[str, Any]]:
    """Per GPU, the step series the backend reported: [time s, memory used GiB, SMACT, power W] per change."""
    return list(_gpu_rows(sim))


def _gpu_rows(sim: Any) -> Iterator[dict[str, Any]]:
    return ({"index": g.index, "node": g.node, "energy_mj": sim.energy_j[g.index] / 1e6,
             "steps": [[round(t, 3), round(used / GiB, 3), round(a, 4), round(p, 1)] for t, used, a, _, _, p in g.history]}
            for g in sim.gpus)


def write_json(sim: Any, out: TextIO) -> None:
    """The ``--json`` document, ``{"version", "summary", "jobs", "gpus"}``, written to ``out`` as it is made:
    one line per job and per GPU, compact separators, NaN as null.

    Why streamed: 100,000 jobs on 1,024 GPUs make a document of hundreds of MB; building it whole (every row
    a dict kept, then one indented string) took as long as the simulation and held all of it in memory."""
    encode = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode

    def dump(row: Any) -> str:
        try:
            return encode(row)
        except ValueError:  # a NaN somewhere (rare): walk the row for it only then
            return encode(clean(row))

    out.write('{"version":1,\n"summary":' + dump(summarise(sim)) + ',\n"jobs":[')
    for name, rows in (("jobs", _job_rows(sim)), ("gpus", _gpu_rows(sim))):
        if name == "gpus":
            out.write('],\n"gpus":[')
        sep = "\n"
        for row in rows:
            out.write(sep + dump(row))
            sep = ",\n"
    out.write("]}\n")


def to_json(sim: Any) -> str:
    """``write_json``'s document as one string."""
    buffer = io.StringIO()
    write_json(sim, buffer)
    return buffer.getvalue()


def clean(value: Any) -> Any:
    """NaN is not JSON: write null instead."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return value


def _caps_word(caps: bool | None) -> str:
    return "-" if caps is None else "on" if caps else "off"


def to_text(summary: dict[str, Any]) -> str:
    s = summary
    lines = [
        f"policy {s['policy']}, estimator {s['estimator']}, {s['nodes']}x{s['gpus_per_node']} {s['gpu']}, seed {s['seed']}",
        f"jobs {s['jobs']}: {s['completed']} completed, {s['failed']} failed; OOMs {s['ooms']} "
        f"({s['neighbour_ooms']} hit a neighbour; caps {_caps_word(s['caps'])}), recoveries {s['recoveries']}",
        f"makespan {s['makespan_s'] / 3600:.2f} h",
        f"JCT mean {s['jct_mean_s'] / 60:.1f} min, p95 {s['jct_p95_s'] / 60:.1f} min",
        f"waiting mean {s['wait_mean_s'] / 60:.1f} min, p95 {s['wait_p95_s'] / 60:.1f} min",
        f"execution mean {s['exec_mean_s'] / 60:.1f} min, p95 {s['exec_p95_s'] / 60:.1f} min",
        f"energy {s['energy_mj']:.2f} MJ; mean SMACT {s['gpu_util_mean']:.2f}, mean memory {s['gpu_mem_mean_gib']:.1f} GiB",
    ]
    if s.get("live"):
        lines.insert(1, s["live"])
    if not s["interference_measured"]:
        lines.append("note: no measured throughputs found; interference used the fallback model only")
    return "\n".join(lines)
