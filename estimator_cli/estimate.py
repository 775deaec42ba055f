"""Capture → per-target estimate: orchestrate, replay through the allocator model, recommend.

One capture serves every target of the same compute-capability class (the allocator sequence does not
depend on memory size); each target gets its own device model, replay and recommendation.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpushare.estimator_cli.allocator import AllocatorConfig, ReplayResult, replay
from gpushare.estimator_cli.device_model import DeviceModel, device_for
from gpushare.estimator_cli.events import Capture
from gpushare.estimator_cli.orchestrate import Orchestrated, orchestrate
from gpushare.estimator_cli.persistent import MemorySplit, split_peak
from gpushare.estimator_cli.reduce_buffer import max_threads_per_sm
from gpushare.estimator_cli.recommend import Recommendation, recommend
from gpushare.config import Config

TOP_N = 8
OTHER_DRIVER_BYTES = 0  # no driver allocations beyond the context are modelled yet (NCCL, IPC, graphs)


@dataclass
class TargetEstimate:
    device: DeviceModel
    replay: ReplayResult
    orchestrated: Orchestrated
    recommendation: Recommendation
    context_bytes: int
    peak_total_bytes: int
    fits: bool
    split: MemorySplit  # persistent / ephemeral parts of the reserved peak (estimator_cli/persistent.py)
    top_modules: list[tuple[str, int]] = field(default_factory=list)
    by_phase: list[tuple[str, int]] = field(default_factory=list)
    by_kind: list[tuple[str, int]] = field(default_factory=list)


def allocator_config(env: Mapping[str, str] | None = None) -> AllocatorConfig:
    env = os.environ if env is None else env
    text = env.get("PYTORCH_CUDA_ALLOC_CONF") or env.get("PYTORCH_ALLOC_CONF") or ""
    return AllocatorConfig.from_env_string(text)


def live_at(orch: Orchestrated, index: int) -> list[int]:
    """Keys of the blocks alive right after replayed event ``index``."""
    live: dict[int, None] = {}
    for op, key, _size, _stream in orch.events[: index + 1]:
        if op == "alloc":
            live[key] = None
        else:
            live.pop(key, None)
    return list(live)


def _breakdown(orch: Orchestrated, keys: list[int]) -> tuple[list, list, list]:
    modules: dict[str, int] = defaultdict(int)
    phases: dict[str, int] = defaultdict(int)
    kinds: dict[str, int] = defaultdict(int)
    for key in keys:
        a = orch.allocs[key]
        modules[a.module or "(outside modules)"] += a.size
        phases[a.phase] += a.size
        kinds[a.kind] += a.size

    def top(d: dict[str, int], n: int | None = None) -> list[tuple[str, int]]:
        return sorted(d.items(), key=lambda kv: -kv[1])[:n]
    return top(modules, TOP_N), top(phases), top(kinds)


def estimate_target(capture: Capture, target: str, cfg: Config, env: Mapping[str, str] | None = None,
                    keep_trace: bool = False) -> TargetEstimate:
    env = os.environ if env is None else env
    probe = device_for(target, cfg.gpus, cublas_workspace_config=env.get("CUBLAS_WORKSPACE_CONFIG"),
                       cublaslt_workspace_size=env.get("CUBLASLT_WORKSPACE_SIZE"),
                       cublaslt_unified=env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE"))
    orch = orchestrate(capture, probe.cublas_workspace_bytes,
                       reduce_target=(probe.sm_count, max_threads_per_sm(probe.sm_arch)),
                       cublaslt_workspace_bytes=probe.cublaslt_workspace_bytes)
    device = device_for(target, cfg.gpus, uses_cublas=orch.uses_cublas, uses_cudnn=orch.uses_cudnn,
                        cublas_workspace_config=env.get("CUBLAS_WORKSPACE_CONFIG"))
    config = allocator_config(env)
    result = replay(orch.events, device.capacity_bytes, config,
                    reserved_elsewhere=device.context_bytes, keep_trace=keep_trace)
    split = split_peak(orch, capture.steps, (result.peak_allocated_bytes, result.peak_reserved_bytes),
                       device.capacity_bytes, config, device.context_bytes, result.oom)
    peak_total = result.peak_reserved_bytes + device.context_bytes + OTHER_DRIVER_BYTES
    rec = recommend(peak_total, device.model, device.mig_profile, cfg.policy, result.oom)
    fits = not result.oom and peak_total <= device.capacity_bytes
    index = result.peak_allocated_event_index if result.peak_allocated_event_index >= 0 else result.peak_event_index
    top_modules, by_phase, by_kind = _breakdown(orch, live_at(orch, index)) if index >= 0 else ([], [], [])
    return TargetEstimate(device, result, orch, rec, device.context_bytes, peak_total, fits, split,
                          top_modules, by_phase, by_kind)


def phase_per_event(orch: Orchestrated) -> list[str]:
    """The phase each replayed event belongs to (a free takes the phase of the latest allocation)."""
    out: list[str] = []
    current = "other"
    for op, key, _size, _stream in orch.events:
        if op == "alloc":
            current = orch.allocs[key].phase
        out.append(current)
    return out
