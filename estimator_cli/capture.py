"""Run the user's script in this process under one capture mode and return what it allocated.

Runs in the child process (estimator_cli/runner.py): the patches below are process-wide, and a script
can do anything to the interpreter, so the parent never imports user code.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from gpushare.estimator_cli.checkpoint_reentry import recompute_under
from gpushare.estimator_cli.cuda_api import PresentedGpu, presented_cuda
from gpushare.estimator_cli.device_mode import CudaPresenter
from gpushare.estimator_cli.events import Capture
from gpushare.estimator_cli.fake_capture import FakeRecorder
from gpushare.estimator_cli.fake_distributed import fake_process_group
from gpushare.estimator_cli.launch_line import WORLD_SIZE_VAR
from gpushare.estimator_cli.lazy_dynamo import lazy_dynamo
from gpushare.estimator_cli.phases import PhaseTracker, StopCapture
from gpushare.estimator_cli.repeat_passes import RepeatPasses
from gpushare.estimator_cli.thread_modes import modes_follow_threads
from gpushare.estimator_cli.torch_patches import gpu_path_patches
from gpushare.estimator_cli.weight_files import header_only_weights


@dataclass
class ScriptRun:
    script: str
    args: list[str]
    steps: int
    gpu: PresentedGpu
    on_step: Callable[[int], None] | None = None
    module: bool = False  # ``script`` is a module name: run as ``python -m script`` runs it

    def main_file(self) -> str:
        """The file that runs as ``__main__`` (a module's, a package's ``__main__.py``)."""
        if not self.module:
            return self.script
        import importlib.util

        try:
            spec = importlib.util.find_spec(self.script)
            if spec is not None and spec.submodule_search_locations:
                spec = importlib.util.find_spec(f"{self.script}.__main__")
        except (ImportError, ValueError):
            spec = None
        return spec.origin if spec is not None and spec.origin else self.script


@contextlib.contextmanager
def _script_environment(run: ScriptRun) -> Iterator[None]:
    """argv, sys.path[0] and cwd-independent module state as ``python SCRIPT ARGS`` would have them; a
    Python child the script starts on this interpreter runs here too (estimator_cli/child_python.py)."""
    from gpushare.estimator_cli.child_python import python_children_in_process

    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [run.script, *run.args]  # runpy.run_module puts the module's file in argv[0]
    script_dir = os.getcwd() if run.module else os.path.dirname(os.path.abspath(run.script))
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    try:
        with python_children_in_process():
            yield
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0


def _run_script(run: ScriptRun, tracker: PhaseTracker) -> bool:
    """Execute the script as ``__main__``; True if stopped after the requested steps.

    Once the requested iterations are complete the capture is whole, so whatever the script or its
    framework does with the stop signal afterwards — catch ``BaseException`` and fail in its teardown
    (Lightning moves the module to the CPU), re-raise something else, or swallow it and carry on to its
    end — does not turn it into a failure."""
    try:
        if run.module:
            runpy.run_module(run.script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(run.script, run_name="__main__")
    except StopCapture:
        return True
    except BaseException as exc:
        if tracker.stop_raised:
            return True
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            return False
        raise
    return tracker.stop_raised


def capture_fake(run: ScriptRun) -> Capture:
    """Fake mode: GPU tensors on meta; see estimator_cli/device_mode.py for why."""
    tracker: PhaseTracker
    recorder = FakeRecorder(lambda: (tracker.phase, tracker.iteration, tracker.module))
    tracker = PhaseTracker(recorder, run.steps, run.on_step)
    presenter = CudaPresenter("meta", run.gpu.major)
    presenter.backward_under_mode = bool(os.environ.get(WORLD_SIZE_VAR))
    repeats = RepeatPasses(recorder, presenter.autocast.cache,
                           reads=lambda: sum(presenter.values.concrete_reads.values()),
                           has_value=lambda t: presenter.values.get(t) is not None)
    torch.__future__.set_swap_module_params_on_conversion(True)  # keep Parameter identity across .to()
    with _script_environment(run), presented_cuda(run.gpu, lambda: recorder.live, lambda: recorder.peak), \
            gpu_path_patches("meta", fake=True), lazy_dynamo(), \
            recompute_under(presenter), fake_process_group(), header_only_weights():
        tracker.install()
        repeats.install()
        try:
            with presenter, recorder, modes_follow_threads():
                stopped = _run_script(run, tracker)
        finally:
            recorder.recording = False
            repeats.remove()
            tracker.remove()
    recorder.finish()
    return Capture(mode="fake", steps=tracker.iteration, stopped=stopped, events=recorder.events,
                   allocs=recorder.allocs, zero_grads=tracker.zero_grads,
                   item_placeholders=presenter.item_calls,
                   value_reads={"concrete": presenter.values.concrete_reads,
                                "placeholder": presenter.values.placeholder_reads},
                   fast_forwarded_passes=repeats.replayed, optimizers_made=tracker.optimizers_made,
                   backward_passes=tracker.backward_passes, micro_steps=tracker.micro_steps,
                   stopped_on_repeat=tracker.stopped_on_repeat)


def capture_profile(run: ScriptRun, trace_dir: str) -> Capture:
    """Profile mode: real CPU execution under ``torch.profiler`` (xMem's method)."""
    from gpushare.estimator_cli.profile_capture import ProfileRecorder, build_capture, ddp_buckets_kept

    recorder = ProfileRecorder()
    tracker = PhaseTracker(recorder, run.steps, run.on_step)
    presenter = CudaPresenter("cpu", run.gpu.major, on_gpu_tensor=recorder.tag)
    presenter.backward_under_mode = bool(os.environ.get(WORLD_SIZE_VAR))
    torch.__future__.set_swap_module_params_on_conversion(True)
    trace_path = os.path.join(trace_dir, "trace.json")
    stopped = False
    with _script_environment(run), presented_cuda(run.gpu, lambda: 0, lambda: 0), \
            gpu_path_patches("cpu", fake=False), lazy_dynamo(), \
            recompute_under(presenter), fake_process_group(), ddp_buckets_kept(recorder):
        tracker.install()
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                      record_shapes=False, with_stack=False)
        try:
            with prof, presenter, modes_follow_threads():
                try:
                    stopped = _run_script(run, tracker)
                finally:
                    recorder.stop()
        finally:
            tracker.remove()
    prof.export_chrome_trace(trace_path)
    capture = build_capture(trace_path, recorder, tracker, stopped)
    capture.optimizers_made, capture.backward_passes = tracker.optimizers_made, tracker.backward_passes
    return capture
