"""The ``--json`` document: a versioned contract (docs/style.md #5, #8). docs/estimator.md lists every field.

Readers check ``schema_version``; new fields may be added within a version, none removed or changed.
Bytes are integers; ``peak_total_bytes`` is what nvidia-smi would show for the process:
``peak_reserved_bytes + context_bytes + other_driver_bytes``.

Fields added within version 1 are ``NotRequired``: documents written before them (the estimate cache,
the estimation spool) still validate, and when present they are checked like the others.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict

from gpushare.config import parse_size

SCHEMA_VERSION = 1
PLAUSIBLE_MAX_BYTES = 16 << 40  # 16 TiB: larger than any GPU for years; beyond is a typo, not a job
# ``#GPUSHARE est=`` (gpushare/estimate/directives.py): the target rows of a document, carried in a batch script
_EST_GPU_RE = re.compile(r"^[a-z0-9][a-z0-9.+:-]{0,62}$")
MAX_EST_TARGETS = 32


class Named(TypedDict):
    name: str  # module path, phase or kind
    bytes: int  # live at the allocated-memory peak


class TargetJson(TypedDict):
    gpu: str  # catalogue name, "a100-40gb" or "a100-40gb:3g.20gb"
    capacity_bytes: int  # whole card, or the MIG instance's usable memory
    peak_allocated_bytes: int  # max of torch.cuda.memory_allocated() (rounded block sizes)
    peak_reserved_bytes: int  # max of torch.cuda.memory_reserved() (allocator segments; no context)
    context_bytes: int  # CUDA context + lazily loaded kernels (device model)
    other_driver_bytes: int  # other driver allocations outside the allocator (0 today)
    peak_total_bytes: int  # nvidia-smi equivalent: reserved + context + other driver
    fits: bool  # peak_total_bytes <= capacity_bytes and the replay did not OOM
    oom: bool  # the allocator replay ran out of memory (even after freeing cached blocks)
    share_of_gpu: float  # peak_total_bytes / capacity_bytes
    recommendation: dict[str, Any]  # gpushare.estimator_cli.recommend.Recommendation fields
    top_modules: list[Named]
    by_phase: list[Named]
    by_kind: list[Named]
    # Added within version 1 (estimator_cli/persistent.py): Salus-style split of the reserved peak.
    persistent_bytes: NotRequired[int]  # reserved for blocks alive at every steady-state iteration boundary
    ephemeral_bytes: NotRequired[int]  # peak_reserved_bytes - persistent_bytes: needed only during an iteration
    persistent_allocated_bytes: NotRequired[int]  # allocated bytes of those blocks (<= persistent_bytes)
    # Added within version 1 (estimator_cli/reduced_batch.py): present when the peak_* fields were
    # extrapolated from reduced-batch profiles; they then include its uncertainty_bytes.
    extrapolation: NotRequired[dict[str, Any]]


class ReportJson(TypedDict):
    schema_version: int  # SCHEMA_VERSION
    tool_version: str
    script: str
    args: list[str]
    mode: str  # "fake" | "profile": the mode that produced the estimate
    requested_mode: str  # "auto" | "fake" | "profile"
    fallback_reason: str | None  # why fake mode was abandoned (the exception text); null if it was not
    iterations: int  # optimizer steps captured (0: the script never stepped: forward-only peak)
    requested_iterations: int
    stopped: bool  # True: stopped after `iterations` steps; False: the script ended by itself
    item_placeholders: int  # `.item()` calls answered with a placeholder that reached only logging
    value_reads: dict[str, dict[str, int]]  # fake mode: {"concrete"|"placeholder": {what was read: count}}
    elapsed_s: float  # wall-clock seconds for the estimate (capture + simulation), excluding cache hits
    capture_process: str  # "warm": forked by the user's warm worker; "cold": a fresh interpreter
    dependencies: list[dict[str, str]]  # [{path, sha256}] of modules the script imported from its project
    cached: bool  # served from the estimate cache
    torch_version: str
    cache_key: str  # sha256 hex of script bytes, args, relevant env, torch version, targets, settings
    allocator_config: str  # PYTORCH_CUDA_ALLOC_CONF used for the simulation
    targets: list[TargetJson]
    # Added within version 1 (estimator_cli/reduced_batch.py): the full batch did not fit --max-cpu-memory in
    # profile mode, so smaller batches were profiled: {knob, full_batch, measured_batches, reason, fit}.
    reduced_batch: NotRequired[dict[str, Any]]
    # Added within version 1: the interpreter the capture ran under (gpu-estimate --python, or its own):
    # {executable, python_version, torch_version, prefix, own}; python_note: why --python was not used.
    python: NotRequired[dict[str, Any]]
    python_note: NotRequired[str]
    # Added within version 1 (estimator_cli/repeat_passes.py): fake mode replayed this many repeated
    # gradient-free passes instead of running them; absent when none was.
    fast_forwarded_passes: NotRequired[int]
    # Added within version 1 (estimator_cli/phases.py): outermost backward passes the capture observed, and
    # true when it stopped at an accumulation micro-step that repeated the one before it after the first step
    # (then iterations is 1: the later windows repeat the second).
    micro_steps: NotRequired[int]
    stopped_on_repeat: NotRequired[bool]


_TARGET_INT = ("capacity_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "context_bytes",
               "other_driver_bytes", "peak_total_bytes")
_SPLIT_INT = ("persistent_bytes", "ephemeral_bytes", "persistent_allocated_bytes")
# postponed annotations hide NotRequired
_TOP_FIELDS = set(ReportJson.__annotations__) - {"reduced_batch", "python", "python_note", "fast_forwarded_passes",
                                                  "micro_steps", "stopped_on_repeat"}
_TARGET_FIELDS = set(TargetJson.__annotations__) - set(_SPLIT_INT) - {"extrapolation"}


def validate(doc: Any) -> list[str]:
    """Problems with a report document (empty list: valid). Checks fields, types and invariants."""
    if not isinstance(doc, dict):
        return ["document is not an object"]
    problems = [f"missing field {k!r}" for k in sorted(_TOP_FIELDS - set(doc))]
    if doc.get("schema_version") != SCHEMA_VERSION:
        problems.append(f"schema_version {doc.get('schema_version')!r} != {SCHEMA_VERSION}")
    if doc.get("mode") not in ("fake", "profile"):
        problems.append(f"mode {doc.get('mode')!r}")
    for i, target in enumerate(doc.get("targets") or []):
        missing = _TARGET_FIELDS - set(target)
        problems += [f"targets[{i}]: missing {k!r}" for k in sorted(missing)]
        for key in _TARGET_INT:
            if key in target and (not isinstance(target[key], int) or target[key] < 0):
                problems.append(f"targets[{i}].{key}: not a non-negative integer")
        if not missing:
            if target["peak_total_bytes"] != (target["peak_reserved_bytes"] + target["context_bytes"]
                                              + target["other_driver_bytes"]):
                problems.append(f"targets[{i}]: peak_total != reserved + context + other")
            if target["peak_allocated_bytes"] > target["peak_reserved_bytes"]:
                problems.append(f"targets[{i}]: allocated peak above reserved peak")
            problems += [f"targets[{i}]: {p}" for p in _split_problems(target)]
            problems += [f"targets[{i}]: {p}" for p in _extrapolation_problems(target)]
    if not doc.get("targets"):
        problems.append("no targets")
    problems += _reduced_batch_problems(doc)
    return problems


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _reduced_batch_problems(doc: dict[str, Any]) -> list[str]:
    """``reduced_batch``: absent, or at least two measured batches, ascending and below the full batch."""
    block = doc.get("reduced_batch")
    if block is None:
        return []
    if not isinstance(block, dict):
        return ["reduced_batch: not an object"]
    problems = [f"reduced_batch: missing {k!r}" for k in ("knob", "full_batch", "measured_batches") if k not in block]
    batches, full = block.get("measured_batches"), block.get("full_batch")
    if not isinstance(batches, list) or len(batches) < 2 or not all(_is_count(b) and b > 0 for b in batches):
        problems.append("reduced_batch.measured_batches: fewer than two positive integers")
    elif batches != sorted(set(batches)) or not _is_count(full) or batches[-1] >= full:
        problems.append("reduced_batch.measured_batches: not ascending below full_batch")
    if not any("extrapolation" in t for t in doc.get("targets") or []):
        problems.append("reduced_batch without any extrapolated target")
    return problems


def _extrapolation_problems(target: dict[str, Any]) -> list[str]:
    """``extrapolation``: the reserved peak is the extrapolated value plus the stated uncertainty."""
    block = target.get("extrapolation")
    if block is None:
        return []
    if not isinstance(block, dict):
        return ["extrapolation: not an object"]
    central, extra = block.get("extrapolated_reserved_bytes"), block.get("uncertainty_bytes")
    if not (isinstance(central, int) and isinstance(extra, int) and _is_count(central) and _is_count(extra)):
        return ["extrapolation: extrapolated_reserved_bytes / uncertainty_bytes not non-negative integers"]
    problems = []
    if central + extra != target["peak_reserved_bytes"]:
        problems.append("extrapolation: peak_reserved != extrapolated + uncertainty")
    if len(block.get("measured") or []) < 2:
        problems.append("extrapolation: fewer than two measured batches")
    return problems


def _split_problems(target: dict[str, Any]) -> list[str]:
    """The persistent/ephemeral fields: all three or none, and they must split the reserved peak exactly."""
    present = [k for k in _SPLIT_INT if k in target]
    if not present:
        return []  # a document written before the split
    if len(present) != len(_SPLIT_INT):
        return [f"missing {k!r}" for k in _SPLIT_INT if k not in target]
    if not all(isinstance(target[k], int) and target[k] >= 0 for k in _SPLIT_INT):
        return ["persistent/ephemeral bytes: not non-negative integers"]
    problems = []
    if target["persistent_bytes"] + target["ephemeral_bytes"] != target["peak_reserved_bytes"]:
        problems.append("persistent + ephemeral != peak_reserved")
    if target["persistent_allocated_bytes"] > target["persistent_bytes"]:
        problems.append("persistent allocated above persistent reserved")
    return problems


# -- reading a document outside the estimator ----------------------------------------------------------
# The submit side and the OOM learner read more than validate() accepts: hand-written estimate files (a
# top-level peak_total_bytes, or ``targets`` as an object keyed by GPU name) and cache documents an OOM
# lesson rewrote. They are not held to the schema; they read the fields they use through these helpers,
# by the schema's own names (``TargetBytes`` lists them for the type checker) and with one test of what a
# usable value is, so every reader accepts and refuses the same values.

# The byte counts of TargetJson (tests/estimator/test_estimator_units.py keeps the two in step).
TargetBytes = Literal["capacity_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "context_bytes",
                      "other_driver_bytes", "peak_total_bytes", "persistent_bytes", "ephemeral_bytes",
                      "persistent_allocated_bytes"]


def target_rows(document: object) -> list[dict[str, Any]]:
    """The per-GPU rows of an estimate document: its ``targets`` list, or a ``targets`` object keyed by GPU
    name (each row then carries that name as ``gpu``). Rows that are not objects are left out; [] when the
    document is not an object or has neither shape."""
    targets = document.get("targets") if isinstance(document, dict) else None
    if isinstance(targets, dict):
        return [dict(value, gpu=key) for key, value in targets.items() if isinstance(value, dict)]
    if isinstance(targets, list):
        return [row for row in targets if isinstance(row, dict)]
    return []


def byte_field(row: Mapping[str, Any], key: TargetBytes) -> int | None:
    """``row[key]`` when it is a JSON integer (``true`` is not one), else None; ranges are the reader's."""
    value = row.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_inline(value: str) -> list[dict[str, int | str]] | str:
    """``est=`` as the target rows of a gpu-estimate document, or what is wrong with it."""
    rows: list[dict[str, int | str]] = []
    items = value.split(",")
    if len(items) > MAX_EST_TARGETS:
        return f"more than {MAX_EST_TARGETS} GPUs"
    for item in items:
        parts = item.split("/")
        gpu = parts[0].lower()
        if not _EST_GPU_RE.match(gpu) or len(parts) not in (2, 4):
            return f"{item[:60]!r}: expected GPU/TOTAL or GPU/TOTAL/PERSISTENT/EPHEMERAL"
        sizes = []
        for text in parts[1:]:
            try:
                size = parse_size(text, default_unit="M")
            except ValueError as exc:
                return f"{item[:60]!r}: {exc}"
            if not 0 <= size <= PLAUSIBLE_MAX_BYTES:
                return f"{item[:60]!r}: {text[:20]!r} is not a plausible GPU memory size"
            sizes.append(size)
        if sizes[0] <= 0 or (len(sizes) == 3 and sizes[1] + sizes[2] > PLAUSIBLE_MAX_BYTES):
            return f"{item[:60]!r}: not a plausible estimate"
        row: dict[str, int | str] = {"gpu": gpu, "peak_total_bytes": sizes[0]}
        if len(sizes) == 3:
            row.update(persistent_bytes=sizes[1], ephemeral_bytes=sizes[2])
        rows.append(row)
    return rows


def inline_value(targets: list[dict[str, Any]]) -> str:
    """The ``est=`` value of gpu-estimate target rows (the inverse of the parser above), sizes in whole MiB
    rounded up so that the job never asks for less than was estimated."""
    items = []
    for row in targets:
        total, gpu = byte_field(row, "peak_total_bytes"), str(row.get("gpu", "")).lower()
        if total is None or not _EST_GPU_RE.match(gpu):
            continue
        sizes = [total]
        persistent, ephemeral = byte_field(row, "persistent_bytes"), byte_field(row, "ephemeral_bytes")
        if persistent is not None and ephemeral is not None:
            sizes += [persistent, ephemeral]
        items.append("/".join([gpu, *(f"{-(-size // (1 << 20))}M" for size in sizes)]))
    return ",".join(items)
