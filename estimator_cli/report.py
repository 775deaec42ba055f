"""Build the report document (gpushare/estimate/schema.py) and render it for humans.

The human text is rendered *from the JSON document*, so a cached estimate prints exactly like a fresh one.
"""

from __future__ import annotations

from typing import Any

from gpushare.estimator_cli.estimate import OTHER_DRIVER_BYTES, TargetEstimate
from gpushare.estimate.schema import SCHEMA_VERSION, Named, TargetJson
from gpushare.gpus import GiB, MiB



def _named(rows: list[tuple[str, int]]) -> list[Named]:
    return [{"name": name, "bytes": int(size)} for name, size in rows]


def target_json(est: TargetEstimate) -> TargetJson:
    cap = est.device.capacity_bytes
    return {
        "gpu": est.device.name, "capacity_bytes": cap,
        "peak_allocated_bytes": int(est.replay.peak_allocated_bytes),
        "peak_reserved_bytes": int(est.replay.peak_reserved_bytes),
        "context_bytes": int(est.context_bytes), "other_driver_bytes": OTHER_DRIVER_BYTES,
        "peak_total_bytes": int(est.peak_total_bytes), "fits": bool(est.fits), "oom": bool(est.replay.oom),
        "share_of_gpu": round(est.peak_total_bytes / cap, 4),
        "recommendation": est.recommendation.to_json(),
        "top_modules": _named(est.top_modules), "by_phase": _named(est.by_phase), "by_kind": _named(est.by_kind),
        "persistent_bytes": int(est.split.persistent_bytes), "ephemeral_bytes": int(est.split.ephemeral_bytes),
        "persistent_allocated_bytes": int(est.split.persistent_allocated_bytes),
    }  # type: ignore[return-value]


def build_document(*, estimates: list[TargetEstimate], script: str, args: list[str], mode: str,
                   requested_mode: str, fallback_reason: str | None, iterations: int, requested_iterations: int,
                   stopped: bool, item_placeholders: int, value_reads: dict[str, dict[str, int]], elapsed_s: float,
                   torch_version: str, cache_key: str,
                   allocator_config: str, tool_version: str, capture_process: str,
                   capture_process_note: str | None, dependencies: list[dict[str, str]],
                   fast_forwarded_passes: int = 0) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "tool_version": tool_version, "script": script, "args": args,
        "mode": mode, "requested_mode": requested_mode, "fallback_reason": fallback_reason,
        "iterations": iterations, "requested_iterations": requested_iterations, "stopped": stopped,
        "item_placeholders": item_placeholders, "value_reads": value_reads, "elapsed_s": round(elapsed_s, 3), "cached": False,
        "torch_version": torch_version, "cache_key": cache_key, "allocator_config": allocator_config,
        "targets": [target_json(e) for e in estimates], "capture_process": capture_process,
        "dependencies": dependencies,
    }
    if fast_forwarded_passes:
        doc["fast_forwarded_passes"] = fast_forwarded_passes
    if capture_process_note:
        doc["capture_process_note"] = capture_process_note  # why not warm; shown with --verbose
    return doc


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def _split_lines(targets: list[dict[str, Any]]) -> list[str]:
    """One line per target: what stays on the GPU between iterations and what one iteration adds on top
    (Salus-style admission). Documents from before the split have no such fields and get no lines."""
    lines = []
    for t in targets:
        if "persistent_bytes" in t:
            lines.append(f"{t['gpu']:<22} reserved = persistent {_gib(t['persistent_bytes'])} (kept between "
                         f"iterations) + ephemeral {_gib(t['ephemeral_bytes'])} (within one)")
    return lines


def _reduced_batch_lines(doc: dict[str, Any]) -> list[str]:
    """What was extrapolated and by how much it may be off (estimator_cli/reduced_batch.py); nothing for a
    document measured at the full batch."""
    block = doc.get("reduced_batch")
    if not block:
        return []
    batches = ", ".join(str(b) for b in block["measured_batches"])
    lines = [f"EXTRAPOLATED: the full batch ({block['knob']} = {block['full_batch']}) did not fit --max-cpu-memory; "
             f"profiled at batch {batches} and fitted peak ≈ a + k·batch; the breakdowns below are at batch "
             f"{block['measured_batches'][-1]}"]
    for t in doc["targets"]:
        ex = t.get("extrapolation")
        if ex:
            lines.append(f"{t['gpu']:<22} extrapolated total {_gib(ex['extrapolated_total_bytes'])} "
                         f"± {_gib(ex['uncertainty_bytes'])} (the total above adds the {_gib(ex['uncertainty_bytes'])}); "
                         f"{ex['slope_bytes_per_sample'] / MiB:.3f} MiB per sample")
    return lines


def render_text(doc: dict[str, Any]) -> str:
    lines = []
    mode = doc["mode"]
    if doc.get("fallback_reason"):
        mode += f" (fell back from fake mode: {doc['fallback_reason']})"
    steps = (f"{doc['iterations']} optimizer steps" if doc["iterations"] else
             "no optimizer step (forward-only peak)")
    if not doc["stopped"] and doc["iterations"]:
        steps += " (the script ended before the requested steps)"
    if doc.get("stopped_on_repeat"):
        steps = (f"{doc['iterations']} optimizer step{'s' if doc['iterations'] != 1 else ''} and "
                 f"{doc.get('micro_steps', 0)} micro-steps "
                 "(stopped once an accumulation micro-step repeated)")
    lines.append(f"gpu-estimate: {doc['script']}  — {steps}, mode {mode}, "
                 f"{doc['elapsed_s']:.1f} s{' (cached)' if doc.get('cached') else ''}")
    python = doc.get("python")
    if isinstance(python, dict):  # documents from before --python have no such field
        whose = "gpu-estimate's own" if python.get("own") else "yours"
        lines.append(f"python: {python.get('executable')} ({whose}): Python {python.get('python_version')}, "
                     f"PyTorch {python.get('torch_version')}")
    lines.append("")
    header = f"{'GPU':<22} {'allocated':>10} {'reserved':>10} {'context':>9} {'total':>10} {'share':>6}  recommendation"
    lines.append(header)
    for t in doc["targets"]:
        rec = t["recommendation"]
        advice = {"shared": f"shared  {rec['request']}", "exclusive": "exclusive gpu:1",
                  "mig": f"MIG {rec['mig_profile']}", "does_not_fit": "DOES NOT FIT"}[rec["kind"]]
        if rec["kind"] in ("shared", "exclusive") and rec.get("mig_profile"):
            advice += f"  (or MIG {rec['mig_profile']})"
        lines.append(f"{t['gpu']:<22} {_gib(t['peak_allocated_bytes']):>10} {_gib(t['peak_reserved_bytes']):>10} "
                     f"{_gib(t['context_bytes']):>9} {_gib(t['peak_total_bytes']):>10} {t['share_of_gpu']:>6.0%}  {advice}")
    lines += _split_lines(doc["targets"])
    lines += _reduced_batch_lines(doc)
    first = doc["targets"][0]
    lines.append(f"margin: {_gib(first['recommendation']['margin_bytes'])} added before sizing "
                 "([policy] margin_fraction / margin_min_gib)")
    lines.append("")
    lines.append(f"top consumers at the peak ({first['gpu']}):")
    for row in first["top_modules"]:
        lines.append(f"  {_gib(row['bytes']):>10}  {row['name']}")
    lines.append("  by phase: " + ", ".join(f"{r['name']} {_gib(r['bytes'])}" for r in first["by_phase"]))
    lines.append("  by kind:  " + ", ".join(f"{r['name']} {_gib(r['bytes'])}" for r in first["by_kind"]))
    if doc.get("item_placeholders"):
        lines.append(f"note: {doc['item_placeholders']} .item() values were placeholders; they reached only "
                     "logging, never control flow")
    concrete = doc.get("value_reads", {}).get("concrete", {})
    if concrete:
        lines.append("note: GPU values read with their real value (small tensors from concrete inputs): "
                     + ", ".join(f"{what} ×{n}" for what, n in sorted(concrete.items())))
    if doc.get("fast_forwarded_passes"):
        lines.append(f"note: {doc['fast_forwarded_passes']} repeated passes without gradients (evaluation, warm-up) "
                     "were fast-forwarded: their recorded allocations replayed, the module not run")
    assumed = {w: n for w, n in doc.get("value_reads", {}).get("placeholder", {}).items() if "assumed" in w}
    if assumed:
        lines.append("note: assumed, as on a normal step: " + ", ".join(f"{w} ×{n}" for w, n in sorted(assumed.items())))
    return "\n".join(lines)
