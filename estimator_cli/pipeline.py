"""capture → orchestrate → simulate → report, for every requested target (docs/estimator.md).

Targets are grouped by what changes the *allocation sequence* (not its size limit): compute capability
class decides the SDPA kernel (flash needs sm80+) and whether bf16 autocast is supported, so sm_8x+ and
older GPUs get one capture each; all targets of a class share it.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any

from gpushare.estimator_cli.events import PresentedGpu
from gpushare.estimator_cli.device_model import DeviceModel, device_for
from gpushare.estimator_cli.estimate import TargetEstimate, allocator_config, estimate_target, phase_per_event
from gpushare.estimator_cli.interpreter import own as own_interpreter
from gpushare.estimator_cli.launcher import CaptureFailed, CaptureOutcome, Limits, run_capture
from gpushare.estimator_cli import reduced_batch
from gpushare.estimator_cli.allocator_config import K_LARGE_BUFFER
from gpushare.estimator_cli.progress import Progress
from gpushare.estimator_cli.report import build_document
from gpushare.config import Config


@dataclass
class Request:
    script: str
    args: list[str]
    targets: list[str]
    mode: str
    iterations: int
    limits: Limits
    plot: str | None
    snapshot: str | None
    cfg: Config
    module: bool = False  # ``script`` is a module name, run as ``python -m`` runs it


def presented(device: DeviceModel) -> PresentedGpu:
    name = device.model.marketing_name
    if device.mig_profile is not None:
        name = f"{name} MIG {device.mig_profile.name}"
    return PresentedGpu(name=name, total_memory=device.capacity_bytes, major=device.sm_arch[0],
                        minor=device.sm_arch[1], multi_processor_count=device.sm_count)


def _arch_class(device: DeviceModel) -> bool:
    return device.sm_arch[0] >= 8


def run(request: Request, key: str, show_progress: bool, tool_version: str) -> tuple[dict[str, Any], str]:
    """Produce the report document; raises launcher.CaptureFailed when no estimate can be made."""
    start = time.monotonic()
    progress = Progress(show_progress)
    devices = [device_for(t, request.cfg.gpus) for t in request.targets]
    captures: dict[bool, CaptureOutcome] = {}
    series: dict[bool, reduced_batch.Series] = {}  # groups whose full batch did not fit --max-cpu-memory
    remaining = dataclasses.replace(request.limits)
    try:
        for device in devices:
            group = _arch_class(device)
            if group in captures:
                continue
            progress.update(f"capturing on {device.name}", force=True)
            remaining.timeout_s = max(1.0, request.limits.timeout_s - (time.monotonic() - start))
            try:
                captures[group] = run_capture(request.script, request.args, request.mode, request.iterations,
                                              presented(device), remaining, progress.update, module=request.module)
            except CaptureFailed as exc:  # reduced-batch profiles and extrapolation, or exc again
                series[group] = _reduced_series(request, device, start, progress, exc)
                largest = series[group].points[-1].outcome
                captures[group] = dataclasses.replace(largest, fallback_reason=exc.fallback_reason)
        estimates: list[TargetEstimate] = []
        for name, device in zip(request.targets, devices):
            progress.update(f"simulating {device.name}", force=True)
            keep = bool(request.snapshot) and not estimates
            estimates.append(estimate_target(captures[_arch_class(device)].capture, name, request.cfg,
                                             keep_trace=keep))
    finally:
        progress.done()
    first = captures[_arch_class(devices[0])]
    interpreter = request.limits.python or own_interpreter()
    if request.plot:
        est = estimates[0]
        write_plot_for(request.plot, est, request.script)
    if request.snapshot:
        with open(request.snapshot, "wb") as handle:
            pickle.dump(estimates[0].replay.snapshot, handle)
    doc = build_document(
        estimates=estimates, script=request.script, args=request.args, mode=first.mode,
        requested_mode=request.mode, fallback_reason=first.fallback_reason, iterations=first.capture.steps,
        requested_iterations=request.iterations, stopped=first.capture.stopped,
        item_placeholders=first.capture.item_placeholders, value_reads=first.capture.value_reads, elapsed_s=time.monotonic() - start,
        torch_version=first.torch_version or interpreter.torch_version, cache_key=key,
        allocator_config=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), tool_version=tool_version,
        capture_process=first.process, capture_process_note=first.process_note,
        dependencies=dependencies(first.local_modules),
        fast_forwarded_passes=first.capture.fast_forwarded_passes)
    doc["micro_steps"] = first.capture.micro_steps
    if first.capture.stopped_on_repeat:
        doc["stopped_on_repeat"] = True
    doc["python"] = dict(interpreter.to_json(), torch_version=doc["torch_version"])
    if series:
        reduced_batch.apply_series(doc, request.targets, [_arch_class(d) for d in devices], series, request.cfg,
                                   K_LARGE_BUFFER)
    output = "".join(c.output for c in captures.values())
    return doc, output


def _reduced_series(request: Request, device: DeviceModel, start: float, progress: Progress,
                    failure: CaptureFailed) -> reduced_batch.Series:
    """Profile captures at reduced batches within what is left of the time limit (reduced_batch.py)."""
    def capture(divisor: int) -> CaptureOutcome:
        limits = dataclasses.replace(request.limits, timeout_s=max(
            1.0, request.limits.timeout_s - (time.monotonic() - start)))
        return run_capture(request.script, request.args, "profile", request.iterations, presented(device),
                           limits, progress.update, batch_divisor=divisor, module=request.module)

    return reduced_batch.run_series(failure, capture, lambda text: progress.update(text, force=True))


def dependencies(paths: list[str]) -> list[dict[str, str]]:
    """``[{path, sha256}]`` of the script's own modules, so a cached estimate is not served after one of
    them changed (estimator_cli/cache.py); an unreadable one is left out (it cannot be checked)."""
    from gpushare.estimator_cli.cache import file_digest

    found = []
    for path in paths:
        digest = file_digest(path)
        if digest is not None:
            found.append({"path": path, "sha256": digest})
    return found


def write_plot_for(path: str, est: TargetEstimate, script: str) -> None:
    from gpushare.estimator_cli.plot import write_plot

    allocated, reserved = est.replay.timeline
    write_plot(path, list(allocated), list(reserved), phase_per_event(est.orchestrated)[: len(allocated)],
               est.context_bytes, f"{os.path.basename(script)} on {est.device.name}")


__all__ = ["Request", "run", "allocator_config"]
