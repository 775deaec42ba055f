"""``gpushare pilot report``, the compute part: what observe mode says gpushare would have done. Pure.

Why a pilot report: ``[policy] mode = "observe"`` records, per GPU job, the decision enforce would have made
(``decision: "observe"``, ``would``, ``new``, ``est_gib``, ``src``, ``why``: gpushare.slurm_plugins.scope) and
the node's half, the would-be cap and backstop stop beside the measured peak (``run.would``, ``run.peak_gib``:
gpushare.policy.observe). An admin turns sharing on after seeing those on the site's own jobs; this module
turns the accounting rows of a period into the findings, each with one line of advice.

Three parts: gather (gpushare.simulator.pilot_cli: ``sacct`` rows -> :class:`Job`), compute (here: functions of a list
of jobs, no I/O, no clock) and render (gpushare.simulator.pilot_render: text, JSON, HTML). A record of a job decided
under enforce is read the same way (its ``decision`` is what observe's ``would`` holds).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from gpushare.gpus import BUILTIN_GPUS
from gpushare.policy.observe import would_share
from gpushare.slurm.tres import gpu_tres

VERSION = 1
KEPT_WHOLE = ("multi-gpu", "multi-node", "heterogeneous", "per-job", "typed", "explicit")


@dataclass(frozen=True)
class Job:
    """One GPU job of the period, as the accounting database has it (times in seconds since the epoch)."""

    job_id: str
    name: str = ""
    user: str = ""
    account: str = ""
    partition: str = ""
    state: str = ""
    submit: float | None = None
    start: float | None = None
    end: float | None = None
    gpus: int = 0  # whole GPUs allocated (gres/gpu)
    shards: int = 0  # shards allocated (gres/shard)
    gpu_type: str | None = None
    record: dict[str, Any] = field(default_factory=dict)  # our gpushare: record (gpushare.slurm.record.stored)

    @property
    def elapsed_s(self) -> float:
        if self.start is None or self.end is None:
            return 0.0
        return max(0.0, self.end - self.start)

    @property
    def wait_s(self) -> float | None:
        return None if self.submit is None or self.start is None else max(0.0, self.start - self.submit)

    @property
    def jct_s(self) -> float | None:
        return None if self.submit is None or self.end is None else max(0.0, self.end - self.submit)

    @property
    def decision(self) -> str | None:
        """What enforce would have decided (observe mode: ``would``; enforce: ``decision``)."""
        d = self.record.get("decision")
        return self.record.get("would") if d == "observe" else d

    @property
    def run(self) -> dict[str, Any]:
        found = self.record.get("run")
        return found if isinstance(found, dict) else {}


def tres(alloc_tres: str) -> tuple[int, int, str | None]:
    """(GPUs, shards, GPU type) from sacct's AllocTRES (read by gpushare.slurm.tres, the one home of that format)."""
    counts = gpu_tres(alloc_tres)
    return int(counts.get("gpu", 0)), int(counts.get("shard", 0)), counts.get("type")


def _num(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def source_of(job: Job) -> str | None:
    """Where the job's estimate came from (directive, cache, learned, async, default), None without one."""
    if _num(job.record.get("est_gib")) is None:
        return None
    src = str(job.record.get("src") or "unknown")
    return src.partition(":")[0]


def no_estimate_reason(job: Job) -> str:
    """Why a GPU job had no estimate, in the report's words."""
    if not job.record:
        return "no gpushare record"
    decision = job.decision or ""
    if job.record.get("decision") == "out-of-scope" or decision == "out-of-scope":
        return "out of scope"
    if decision in ("multi-gpu", "multi-node"):
        return "multi-GPU kept whole"
    if decision in KEPT_WHOLE:
        return f"kept whole ({decision})"
    why = str(job.record.get("why") or "")
    if "line found" in why or "without a script" in why or "runs a module" in why:
        return "no training line found"
    if job.record.get("est_job") is not None or job.record.get("src") == "async":
        return "estimate failed"
    return f"no estimate ({decision or 'unknown'})"


def coverage(jobs: list[Job]) -> dict[str, Any]:
    """GPU jobs seen; how many had an estimate and from where; how many had none and why."""
    sources: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for job in jobs:
        src = source_of(job)
        if src is not None:
            sources[src] = sources.get(src, 0) + 1
        else:
            reason = no_estimate_reason(job)
            reasons[reason] = reasons.get(reason, 0) + 1
    return {"jobs": len(jobs), "with_estimate": sum(sources.values()), "sources": dict(sorted(sources.items())),
            "without_estimate": sum(reasons.values()), "reasons": dict(sorted(reasons.items()))}


def gpu_shards(job: Job) -> int | None:
    """Shards (GiB) of the job's GPU model, where its type names a known one."""
    model = BUILTIN_GPUS.get((job.gpu_type or "").lower())
    return model.shards if model is not None else None


def would_shards(job: Job) -> int | None:
    """Shards the job would have asked for shared, None when it would not have shared."""
    found = would_share(job.record) if job.record.get("decision") == "observe" else None
    if found is None and job.record.get("decision") == "shared":
        found = would_share({**job.record, "decision": "observe", "would": "shared"})
    return found[0] if found else None


def sharing(jobs: list[Job]) -> dict[str, Any]:
    """Jobs that would have shared, by partition and account, and the GPU-hours their whole GPUs held against
    what their shares would have held (shards / the GPU's shards, for the job's run time)."""
    by: dict[str, dict[str, dict[str, float]]] = {"partition": {}, "account": {}}
    total = {"jobs": 0, "gpu_hours_exclusive": 0.0, "gpu_hours_shared": 0.0, "unknown_gpu_type": 0}
    for job in jobs:
        shards = would_shards(job)
        if shards is None:
            continue
        hours = job.elapsed_s / 3600
        exclusive = hours * max(job.gpus, 1)
        size = gpu_shards(job)
        shared = hours * min(1.0, shards / size) if size else exclusive
        total["jobs"] += 1
        total["gpu_hours_exclusive"] += exclusive
        total["gpu_hours_shared"] += shared
        total["unknown_gpu_type"] += 0 if size else 1
        for key, name in (("partition", job.partition), ("account", job.account)):
            row = by[key].setdefault(name or "?", {"jobs": 0, "gpu_hours_exclusive": 0.0, "gpu_hours_shared": 0.0})
            row["jobs"] += 1
            row["gpu_hours_exclusive"] += exclusive
            row["gpu_hours_shared"] += shared
    seen: dict[str, dict[str, int]] = {"partition": {}, "account": {}}
    for job in jobs:
        for key, name in (("partition", job.partition), ("account", job.account)):
            seen[key][name or "?"] = seen[key].get(name or "?", 0) + 1
    for key in by:
        for name, count in seen[key].items():
            by[key].setdefault(name, {"jobs": 0, "gpu_hours_exclusive": 0.0, "gpu_hours_shared": 0.0})
            by[key][name]["gpu_jobs"] = count
    return {**{k: round(v, 3) if isinstance(v, float) else v for k, v in total.items()},
            "by_partition": _rounded(by["partition"]), "by_account": _rounded(by["account"])}


def _rounded(table: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {name: {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
            for name, row in sorted(table.items())}


def would_cap_gib(job: Job) -> float | None:
    """The memory cap the job would have run under: the node's record, else estimate + margin, else shards."""
    node = job.run.get("would")
    if isinstance(node, dict) and _num(node.get("cap_gib")) is not None:
        return _num(node.get("cap_gib"))
    est, margin = _num(job.record.get("est_gib")), _num(job.record.get("margin_gib"))
    if est is not None:
        return est + (margin or 0.0)
    shards = would_shards(job)
    return float(shards) if shards else None


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile by the nearest-rank rule (q in 0..1)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def safety(jobs: list[Job], worst: int = 5) -> dict[str, Any]:
    """Each would-share job's would-be cap against its measured peak: over the cap (a requeue each, costing the
    run's GPU-hours on a whole GPU again), the estimate's error (estimate - peak, GiB; negative: under), the
    worst under-estimates by script, and the backstop stops observe mode recorded."""
    points: list[dict[str, Any]] = []
    over: list[dict[str, Any]] = []
    errors: list[float] = []
    under: dict[str, float] = {}
    stops = 0
    eligible = measured = 0
    for job in jobs:
        if would_shards(job) is None:
            continue
        eligible += 1
        node = job.run.get("would")
        if isinstance(node, dict) and node.get("stop") == "backstop":
            stops += 1
        peak, cap = _num(job.run.get("peak_gib")), would_cap_gib(job)
        if peak is None or cap is None:
            continue
        measured += 1
        points.append({"job": job.job_id, "partition": job.partition, "cap_gib": cap, "peak_gib": peak,
                       "over": peak > cap})
        if peak > cap:
            over.append({"job": job.job_id, "peak_gib": peak, "cap_gib": cap,
                         "requeue_gpu_hours": round(job.elapsed_s / 3600 * max(job.gpus, 1), 3)})
        est = _num(job.record.get("est_gib"))
        if est is not None:
            errors.append(est - peak)
            if est < peak:
                script = str(job.record.get("script") or job.name or job.job_id)
                under[script] = min(under.get(script, 0.0), est - peak)
    worst_under = sorted(under.items(), key=lambda kv: kv[1])[:worst]
    return {"eligible": eligible, "measured": measured, "over_cap": len(over),
            "over_cap_pct": round(100 * len(over) / measured, 1) if measured else None,
            "requeue_gpu_hours": round(sum(float(o["requeue_gpu_hours"]) for o in over), 3), "over": over,
            "error_gib": {"n": len(errors), "median": _r(statistics.median(errors) if errors else None),
                          "p90_abs": _r(percentile([abs(e) for e in errors], 0.9)),
                          "worst_under": _r(min(errors) if errors else None)},
            "worst_under_by_script": [{"script": s, "error_gib": round(e, 2)} for s, e in worst_under],
            "backstop_stops": stops, "points": points}


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def recorded(jobs: list[Job]) -> dict[str, Any]:
    """Mean and p95 wait and JCT as Slurm recorded them (jobs that started / ended)."""
    waits = [w for j in jobs if (w := j.wait_s) is not None]
    jcts = [c for j in jobs if (c := j.jct_s) is not None]
    return {"wait_mean_s": _r(statistics.fmean(waits) if waits else None), "wait_p95_s": _r(percentile(waits, 0.95)),
            "jct_mean_s": _r(statistics.fmean(jcts) if jcts else None), "jct_p95_s": _r(percentile(jcts, 0.95)),
            "waits_s": [round(w, 1) for w in waits]}


def spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The what-if's runs (one per seed and utilisation model: {seed, util, wait_mean_s, ...}) as mean, min and
    max per metric, overall and per utilisation model."""
    keys = ("wait_mean_s", "wait_p95_s", "jct_mean_s", "jct_p95_s")

    def stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"runs": len(rows)}
        for key in keys:
            values = [float(r[key]) for r in rows if _num(r.get(key)) is not None]
            out[key] = {"mean": _r(statistics.fmean(values)), "min": _r(min(values)), "max": _r(max(values))} \
                if values else None
        return out

    def against_exclusive(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Live's mean JCT against Exclusive on the same simulated cluster, %: mean, min, max over the runs."""
        changes = [100 * (r["jct_mean_s"] / r["exclusive_jct_mean_s"] - 1) for r in rows
                   if _num(r.get("jct_mean_s")) is not None and (_num(r.get("exclusive_jct_mean_s")) or 0) > 0]
        return {"mean": _r(statistics.fmean(changes)), "min": _r(min(changes)), "max": _r(max(changes))} \
            if changes else None

    utils = sorted({str(r.get("util")) for r in runs})
    out = {"all": stats(runs), "by_util": {u: stats([r for r in runs if str(r.get("util")) == u]) for u in utils}}
    out["all"]["jct_mean_vs_exclusive_pct"] = against_exclusive(runs)
    for u in utils:
        out["by_util"][u]["jct_mean_vs_exclusive_pct"] = against_exclusive([r for r in runs if str(r.get("util")) == u])
    return out


def advice(doc: dict[str, Any], margin_pct: float = 2.0) -> list[str]:
    """One line per finding, for the admin."""
    lines = []
    cov = doc["coverage"]
    if cov["jobs"]:
        missing = cov["without_estimate"] / cov["jobs"]
        top = max(cov["reasons"].items(), key=lambda kv: kv[1])[0] if cov["reasons"] else None
        lines.append(f"coverage: {cov['with_estimate']} of {cov['jobs']} GPU jobs had an estimate"
                     + (f"; most of the rest: {top} ({cov['reasons'][top]})" if top else "")
                     + ("; ask users for '#GPUSHARE mem=' lines or turn on asynchronous estimation"
                        if missing > 0.5 else ""))
    share = doc["sharing"]
    if share["jobs"]:
        saved = share["gpu_hours_exclusive"] - share["gpu_hours_shared"]
        lines.append(f"sharing: {share['jobs']} jobs would have shared; their whole GPUs held "
                     f"{share['gpu_hours_exclusive']:.1f} GPU-hours where their shares needed "
                     f"{share['gpu_hours_shared']:.1f} ({saved:.1f} freed)")
    else:
        lines.append("sharing: no job would have shared in this period; nothing to gain from enforce yet")
    safe = doc["safety"]
    if safe["measured"]:
        pct = safe["over_cap_pct"] or 0.0
        if pct > margin_pct:
            lines.append(f"safety: raise the margin: {pct:g} % of measured would-share jobs would have been over "
                         f"their cap ({safe['over_cap']} requeue(s), {safe['requeue_gpu_hours']:.1f} GPU-hours)")
        else:
            lines.append(f"safety: {safe['over_cap']} of {safe['measured']} measured would-share jobs over their cap "
                         f"({pct:g} %): the margin holds")
        if safe["worst_under_by_script"]:
            worst = safe["worst_under_by_script"][0]
            lines.append(f"estimates: worst under-estimate {worst['error_gib']:+.2f} GiB ({worst['script']}): "
                         "check that script's '#GPUSHARE mem=' line or its estimate")
    elif safe["eligible"]:
        lines.append("safety: no would-share job has a measured peak: is the agent running on the GPU nodes?")
    if safe["backstop_stops"]:
        lines.append(f"backstop: {safe['backstop_stops']} job(s) would have been stopped above their cap: "
                     "see their jobstats before enforcing")
    whatif = doc.get("whatif") or {}
    rec, sim = doc.get("recorded") or {}, (whatif.get("spread") or {}).get("all") or {}
    if rec.get("jct_mean_s") and sim.get("jct_mean_s"):
        lo, hi = sim["jct_mean_s"]["min"], sim["jct_mean_s"]["max"]
        lines.append(f"what-if: live's mean JCT {lo / rec['jct_mean_s'] - 1:+.0%} to {hi / rec['jct_mean_s'] - 1:+.0%} "
                     f"against Slurm's recorded over {sim['runs']} runs (seeds x utilisation models); the simulated "
                     "cluster differs from yours, so judge by the next line")
    harm = sim.get("jct_mean_vs_exclusive_pct") if sim else None
    if harm:
        verdict = ("sharing would lengthen jobs at this load: keep observing, check share_when" if harm["max"] > 2 else
                   "sharing would shorten jobs whichever utilisation model is right" if harm["max"] < 0 else
                   "within 2 % of whole GPUs at worst (do-no-harm holds)")
        lines.append(f"do-no-harm: on the same simulated cluster live's mean JCT is {harm['min']:+.1f} % to "
                     f"{harm['max']:+.1f} % against whole GPUs: {verdict}")
    return lines


def build(jobs: list[Job], whatif_runs: list[dict[str, Any]] | None = None, period: dict[str, Any] | None = None,
          simulated_waits: list[float] | None = None) -> dict[str, Any]:
    """The pilot report document (``v`` 1)."""
    doc: dict[str, Any] = {"v": VERSION, "period": period or {}, "coverage": coverage(jobs),
                           "sharing": sharing(jobs), "safety": safety(jobs), "recorded": recorded(jobs),
                           "whatif": {"runs": whatif_runs or [], "spread": spread(whatif_runs) if whatif_runs else None,
                                      "waits_s": [round(w, 1) for w in simulated_waits or []]}}
    doc["advice"] = advice(doc)
    return doc
