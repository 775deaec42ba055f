"""Parent side of a capture: start the child, enforce the wall-clock limit, apply the ``auto`` fallback.

The child (estimator_cli/runner.py) runs as the invoking user in its own session, so a timeout can kill
the script and anything it started (process group). Its stdout/stderr go to files that the CLI shows
only with ``--verbose``. The child is forked by the user's warm worker (estimator_cli/warm_worker.py)
when ``Limits.warm_idle_s`` allows one, else started as a fresh interpreter ("cold"); both behave the same.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from gpushare.estimator_cli.events import PresentedGpu
from gpushare.estimator_cli.events import Capture
from gpushare.estimator_cli.interpreter import Interpreter, capture_path, child_env, runner_command


class CaptureFailed(Exception):
    """The capture produced no estimate. ``status`` picks the exit code (see estimator_cli/cli.py)."""

    def __init__(self, status: str, message: str, traceback_tail: str = "", output: str = "",
                 mode: str | None = None, fallback_reason: str | None = None,
                 batch: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status  # "script_error" | "timeout" | "limit" | "internal"
        self.traceback_tail = traceback_tail
        self.output = output
        # Set on a memory-limit failure, for the reduced-batch fallback (estimator_cli/reduced_batch.py):
        self.mode = mode  # the capture mode that hit the limit
        self.fallback_reason = fallback_reason  # why fake mode was abandoned before it, when it was
        self.batch = batch  # the child's BatchKnob.to_json(): which batch knob the script has, if any


@dataclass
class CaptureOutcome:
    capture: Capture
    mode: str  # the mode that produced the capture
    fallback_reason: str | None  # why fake mode was abandoned, when it was
    output: str  # the script's stdout+stderr (all attempts)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    process: str = "cold"  # "warm": forked by the warm worker; "cold": a fresh interpreter
    process_note: str | None = None  # why the warm worker was not used, when it was wanted
    local_modules: list[str] = field(default_factory=list)  # the script's own imported modules
    batch: dict[str, Any] | None = None  # profile mode: the child's BatchKnob.to_json() (reduced_batch.py)
    torch_version: str | None = None  # the child's torch.__version__ (under --python: the user's PyTorch)


@dataclass
class Limits:
    timeout_s: float
    max_address_space: int  # bytes; 0 = unlimited
    warm_idle_s: float = 0.0  # >0: use (or start) a warm worker that lingers this long; 0: always cold
    python: Interpreter | None = None  # the user's interpreter (--python); None: gpu-estimate's own


def _start(runner_args: list[str], env: dict[str, str], log: str, log_handle: Any, limits: Limits,
           deadline: float, on_progress: Callable[[str], None] | None) -> tuple[Any, str, str | None]:
    """The child, which kind it is ("warm" or "cold"), and why not warm when a warm one was wanted."""
    note = None
    if limits.python is not None and not limits.python.own:  # the user's environment: always a fresh child
        if limits.warm_idle_s > 0:
            note = "warm worker not used: the capture runs under --python"
        path_dir = capture_path(os.path.dirname(log))
        proc = subprocess.Popen([limits.python.path, "-c", runner_command(path_dir), *runner_args],
                                stdin=subprocess.DEVNULL, stdout=log_handle, stderr=subprocess.STDOUT,
                                env=child_env(env, path_dir), start_new_session=True)
        return proc, "cold", note
    if limits.warm_idle_s > 0:
        from gpushare.estimator_cli.warm_worker import WarmChild, WarmUnavailable, ensure_worker

        try:
            if on_progress is not None:
                on_progress("connecting to the warm worker")
            path = ensure_worker(limits.warm_idle_s, max(1.0, deadline - time.monotonic()))
            return WarmChild(path, runner_args, env, os.getcwd(), log), "warm", None
        except (WarmUnavailable, OSError, ValueError, subprocess.SubprocessError) as exc:
            note = f"warm worker not used: {exc}"
    proc = subprocess.Popen([sys.executable, "-m", "gpushare.estimator_cli.runner", *runner_args], stdin=subprocess.DEVNULL,
                            stdout=log_handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, "cold", note


def _run_child(mode: str, script: str, args: list[str], steps: int, gpu: PresentedGpu, limits: Limits,
               deadline: float, on_progress: Callable[[str], None] | None, batch_divisor: int = 1,
               module: bool = False) -> tuple[dict[str, Any], str, str, str | None]:
    """The child's result document and output, with the kind of child (see ``_start``)."""
    with tempfile.TemporaryDirectory(prefix="gpu-estimate-") as tmp:
        out, status, log = (os.path.join(tmp, n) for n in ("result.json", "status", "output.log"))
        runner_args = ["--mode", mode, "--steps", str(steps), "--out", out, "--status", status,
                       "--max-address-space", str(limits.max_address_space), "--gpu", json.dumps(asdict(gpu)),
                       "--batch-divisor", str(batch_divisor), *(["--module"] if module else []), script, "--", *args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(log, "wb") as log_handle:
            proc, process, note = _start(runner_args, env, log, log_handle, limits, deadline, on_progress)
            try:
                while proc.poll() is None:
                    if time.monotonic() > deadline:
                        _kill(proc)
                        raise CaptureFailed("timeout", f"the script did not reach {steps} optimizer steps within "
                                            f"the time limit (raise it with --timeout)", output=_read(log))
                    if on_progress is not None and os.path.exists(status):
                        on_progress(f"{mode}: step {_read(status).strip()}")
                    time.sleep(0.05)
            except BaseException:
                if proc.poll() is None:
                    _kill(proc)
                raise
        output = _read(log)
        if not os.path.exists(out):
            if proc.returncode and proc.returncode < 0:
                sig = signal.Signals(-proc.returncode).name
                raise CaptureFailed("limit", f"the script was killed by {sig} (memory or CPU limit? "
                                    f"see --max-cpu-memory)", output=output)
            raise CaptureFailed("script_error", f"the script ended the process (exit status {proc.returncode}) "
                                "before the estimate was taken", traceback_tail=output[-3000:], output=output)
        with open(out, encoding="utf-8") as handle:
            result = json.load(handle)
        if process == "warm" and result.get("framework_modules"):
            from gpushare.estimator_cli.preload import remember

            remember(proc.path, list(result["framework_modules"]))
        return result, output, process, note


def _kill(proc: Any) -> None:
    """Kill the child's process group (the script and whatever it started), then reap it. A warm child
    may not have made its own group yet in its first instant: then the child alone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""


_FAKE_FIRST = "fake mode had stopped first: "
# "Could not run 'flash_attn::_flash_attn_forward' with arguments from the 'Meta' backend": a custom
# operator (not aten's) registered for the GPU only
# operator (not aten's) registered for the GPU only; or the meta-tensor refusal of such an operator
_GPU_ONLY_RES = (
    re.compile(r"Could not run '([A-Za-z0-9_]+)::([A-Za-z0-9_.]+)' with arguments from the '(?:Meta|CUDA|CPU)'"),
    re.compile(r"^([A-Za-z0-9_]+)::([A-Za-z0-9_.]+): attempted to run this operator with Meta tensors, but there "
               r"was no fake impl or Meta kernel"),
)


def gpu_only_kernel(message: str) -> str | None:
    """The custom GPU operator a capture failure names (flash_attn, xformers, bitsandbytes, ...), if any."""
    for pattern in _GPU_ONLY_RES:
        match = pattern.search(message)
        if match is not None and match.group(1) not in ("aten", "prims"):
            return f"{match.group(1)}::{match.group(2)}"
    return None


def did_not_train(capture: Capture, output: str) -> str | None:
    """Why a capture that ended by itself is no estimate, or None. A run that made an optimizer but reached
    no step of it, or that ended before putting anything on the GPU, did not train: its peak (often 0) is
    not the job's. A forward-only run (no optimizer, no backward, activations on the GPU: batch inference)
    is an estimate of its own kind."""
    if capture.steps > 0 or capture.stopped:
        return None
    if capture.optimizers_made:
        what = "made an optimizer but ended before its first optimizer step"
    elif capture.backward_passes:
        return None  # its own update rule: backward passes are its iterations (phases.py)
    elif not any(a.phase == "forward" for a in capture.allocs.values()):
        what = ("ended before a forward pass on the GPU" if capture.allocs else
                "ended without putting anything on the GPU")
    else:
        return None
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
    said = f"; its last output line: {last[:200]!r}" if last else ""
    return f"the script {what}, so there is nothing to estimate{said}"


# What a script reads that only a launcher (torchrun, accelerate launch, deepspeed, srun) sets: the failure
# of reading it without one (os.environ["LOCAL_RANK"], init_process_group's env:// rendezvous)
_LAUNCHER_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_LAUNCHER_VAR_RE = re.compile(r"^'?(%s)'?$|environment variable (%s) expected" % (("|".join(_LAUNCHER_VARS),) * 2))


def needs_launcher(error: dict[str, Any]) -> str | None:
    """One line for a script that failed reading a launcher's variable while run without a launcher."""
    from gpushare.estimator_cli.launch_line import WORLD_SIZE_VAR

    if os.environ.get(WORLD_SIZE_VAR):
        return None  # a launcher line was given: the variables were set, the failure is the script's own
    message = str(error.get("message") or "")
    match = _LAUNCHER_VAR_RE.search(message) if error.get("type") in ("KeyError", "ValueError", "RuntimeError") else None
    if match is None:
        return None
    where = f" at {error['where']}" if error.get("where") else ""
    return (f"the script reads {match.group(1) or match.group(2)}{where}, which its launcher sets: estimate it with "
            "its launcher line, e.g. gpu-estimate torchrun --nproc_per_node=N SCRIPT ARGS (or accelerate launch, "
            "deepspeed, srun)")


def run_capture(script: str, args: list[str], mode: str, steps: int, gpu: PresentedGpu, limits: Limits,
                on_progress: Callable[[str], None] | None = None, batch_divisor: int = 1,
                module: bool = False) -> CaptureOutcome:
    """Capture in ``mode`` ("fake", "profile" or "auto": fake, then profile when fake cannot go on).
    ``batch_divisor`` > 1 divides the script's batch size in profile mode (estimator_cli/reduced_batch.py)."""
    deadline = time.monotonic() + limits.timeout_s
    order = ["fake", "profile"] if mode == "auto" else [mode]
    outputs: list[str] = []
    attempts: list[dict[str, Any]] = []
    fallback: str | None = None
    for attempt in order:
        try:
            result, output, process, note = _run_child(attempt, script, args, steps, gpu, limits, deadline,
                                                       on_progress, batch_divisor, module)
        except CaptureFailed as exc:  # a time-out or a killed child after fake mode gave up: say why it did
            if fallback:
                exc.args = (f"{exc}; {_FAKE_FIRST}{fallback}",)
                exc.fallback_reason = exc.fallback_reason or fallback
            raise
        outputs.append(output)
        status, error = result["status"], result.get("error") or {}
        where = f" at {error['where']}" if error.get("where") else ""
        also = f"; {_FAKE_FIRST}{fallback}" if fallback else ""
        attempts.append({"mode": attempt, "status": status, "error": error.get("message")})
        if status == "ok":
            capture = Capture.from_json(result["capture"])
            untrained = did_not_train(capture, output)
            if untrained:  # the same script ends the same way in profile mode: no fallback
                raise CaptureFailed("script_error", f"{untrained}{also}", "", "".join(outputs))
            return CaptureOutcome(capture, attempt, fallback, "".join(outputs), attempts,
                                  process, note, list(result.get("local_modules") or []), result.get("batch"),
                                  result.get("torch_version"))
        if status == "limit":
            raise CaptureFailed("limit", f"the script ran out of memory in {attempt} mode{where} "
                                f"({error.get('message')}); raise --max-cpu-memory{also}", error.get("traceback", ""),
                                "".join(outputs),
                                attempt, fallback, result.get("batch"))
        launcher = needs_launcher(error)
        if launcher:  # the same in profile mode: no fallback
            raise CaptureFailed("script_error", launcher, error.get("traceback", ""), "".join(outputs))
        kernel = gpu_only_kernel(error.get("message", "")) if status != "ok" else None
        if kernel:  # profile mode runs on the CPU, which has no such kernel either: no fallback, no time-out
            raise CaptureFailed("unsupported", f"{error.get('where') or script}: {kernel} is a GPU-only kernel "
                                "with no fake (meta) implementation; gpu-estimate cannot run it on a CPU",
                                error.get("traceback", ""), "".join(outputs))
        retry = mode == "auto" and attempt == "fake" and status in ("data_dependent", "fake_error")
        if retry:
            message = error.get("message", "").split(". ")[0]  # first sentence: torch's are long
            fallback = f"{error.get('type', 'Error')}: {message}".strip()[:300]
            continue
        if status == "data_dependent":
            raise CaptureFailed("unsupported", f"fake mode cannot estimate this script: {error.get('message')} "
                                "(use --mode auto or --mode profile)", error.get("traceback", ""), "".join(outputs))
        raise CaptureFailed("script_error", f"the script failed in {attempt} mode{where}: {error.get('type')}: "
                            f"{error.get('message')}{also}", error.get("traceback", ""), "".join(outputs))
    raise CaptureFailed("internal", "no capture mode produced an estimate")
