"""Child-process entry point: ``python -m gpushare.estimator_cli.runner --out RESULT.json ... -- SCRIPT ARGS``.

Why a separate process: the script runs with process-wide patches, may leak memory, loop, or call
``os._exit``; limits (address space via ``setrlimit``) must not apply to the parent; and a crash must not
take the CLI with it. It runs as the invoking user — nothing here changes identity.

The result file is JSON: ``{"status": ..., "capture": {...} | null, "error": {...} | null}`` with status
``ok``, ``script_error`` (the script failed by itself), ``data_dependent`` (fake mode needs values),
``fake_error`` (an exception that may be fake mode's doing) or ``limit`` (memory limit hit).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import runpy
import sys
import tempfile
import traceback
from typing import Any

TRACEBACK_TAIL_LINES = 20


_OWN_DIRS = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(runpy.__file__)))


def _script_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The frames of the script and its libraries (not ours, torch's or runpy's), outermost first."""
    import torch

    hidden = _OWN_DIRS + (os.path.dirname(os.path.abspath(torch.__file__)),)
    return [f for f in traceback.extract_tb(exc.__traceback__)
            if not os.path.abspath(f.filename).startswith(hidden) and not f.filename.startswith("<frozen")]


def _where(exc: BaseException, script: str, own_only: bool = False) -> str:
    """``file:line`` of the failing line in the script itself (else, unless ``own_only``, the innermost frame
    shown): the one place a researcher looks first for a wrong path or an unsupported call."""
    frames = _script_frames(exc)
    own = [f for f in frames if os.path.abspath(f.filename) == os.path.abspath(script)]
    chosen = own or ([] if own_only else frames)
    return f"{chosen[-1].filename}:{chosen[-1].lineno}" if chosen else ""


def _traceback_tail(exc: BaseException) -> str:
    """The script's frames (not ours, torch's or runpy's) and the exception, last lines only."""
    frames = _script_frames(exc)
    lines = "".join(traceback.format_list(frames) + traceback.format_exception_only(exc)).rstrip().splitlines()
    return "\n".join(lines[-TRACEBACK_TAIL_LINES:])


def first_cause(exc: BaseException) -> BaseException:
    """The earliest exception of the chain that ended the script (``raise ... from``, or an error raised
    while handling another): a framework's cleanup error must not hide what went wrong first."""
    seen = {id(exc)}
    while True:
        inner = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if inner is None or id(inner) in seen or type(inner).__name__ == "StopCapture":
            return exc
        seen.add(id(inner))
        exc = inner


def _error(exc: BaseException, script: str = "") -> dict[str, Any]:
    cause = first_cause(exc)
    error = {"type": type(cause).__name__, "message": str(cause)[:2000], "traceback": _traceback_tail(cause)}
    if script:  # the first cause's traceback may hold only the frames below its handler
        # the script's own line first, from whichever exception of the chain still has it (a library that
        # re-raises, as transformers does for a model path that does not exist, cuts it from the first)
        error["where"] = _where(cause, script, own_only=True) or _where(exc, script, own_only=True) \
            or _where(cause, script) or _where(exc, script)
    if cause is not exc:
        error["then"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        error["traceback"] += f"\n(while handling it, then: {type(exc).__name__}: {str(exc)[:300]})"
    return error


def _out_of_memory(exc: BaseException) -> bool:
    """PyTorch's CPU allocator reports an exhausted address space as a RuntimeError, not MemoryError."""
    text = str(exc)
    return "can't allocate memory" in text or "DefaultCPUAllocator" in text


def _needs_values(exc: BaseException) -> bool:
    """Fake mode's known limits: ops with data-dependent output shapes (nonzero, boolean masks, unique)
    have no meta implementation, and copying a meta tensor out needs its data."""
    text = str(exc)
    return isinstance(exc, NotImplementedError) or "meta tensor" in text.lower() or "data-dependent" in text


MAX_LOCAL_MODULES = 1000


def _holds_distributions(path: str) -> bool:
    """An installation directory outside the interpreter's own site directories: it holds ``*.dist-info``
    records (PyTorch on ``PYTHONPATH`` from an environment module, or added by a ``.pth`` line)."""
    try:
        return os.path.isdir(path) and any(name.endswith(".dist-info") for name in os.listdir(path))
    except OSError:
        return False


def local_modules(script: str, already: set[str]) -> list[str]:
    """Source files of the modules the script imported (not in ``already``, the modules loaded before it
    ran) from outside the installation — its own project, PYTHONPATH: the cache must notice when one of
    them changes (estimator_cli/cache.py)."""
    import site
    import sysconfig

    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                           *site.getsitepackages(), site.getusersitepackages(),
                                           *sysconfig.get_paths().values(), _OWN_DIRS[0],
                                           os.path.join(os.path.dirname(_OWN_DIRS[0]), "gpushare"))}
    roots |= {os.path.realpath(p) for p in sys.path if _holds_distributions(p)}  # a module's or a .pth's PyTorch
    roots = {r + os.sep for r in roots if r and r != os.sep}
    found = {os.path.realpath(script)}
    for name, module in list(sys.modules.items()):
        if name in already:
            continue
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not path.endswith(".py") or name.split(".")[0] == "gpushare":
            continue  # ours (under --python, linked from a temporary directory: estimator_cli/interpreter.py)
        real = os.path.realpath(path)
        if not any(real.startswith(r) for r in roots) and os.path.isfile(real):
            found.add(real)
        if len(found) > MAX_LOCAL_MODULES:
            break
    found.discard(os.path.realpath(script))  # the script's own bytes are in the cache key already
    return sorted(found)


def _set_limits(max_address_space: int) -> None:
    if max_address_space > 0:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = max_address_space if hard == resource.RLIM_INFINITY else min(max_address_space, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _status_writer(path: str | None, steps: int) -> Any:
    def on_step(done: int) -> None:
        if path:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(f"{done}/{steps}\n")
    return on_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpushare.estimator_cli.runner")
    parser.add_argument("--mode", choices=("fake", "profile"), required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--status")
    parser.add_argument("--max-address-space", type=int, default=0)
    parser.add_argument("--gpu", required=True, help="JSON of PresentedGpu fields")
    parser.add_argument("--batch-divisor", type=int, default=1, help="profile mode: divide the batch size")
    parser.add_argument("--module", action="store_true", help="SCRIPT is a module, run as python -m runs it")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args(argv)
    args = opts.args[1:] if opts.args[:1] == ["--"] else opts.args
    result: dict[str, Any] = {"status": "ok", "capture": None, "error": None}
    knob = None
    try:
        _set_limits(opts.max_address_space)
        if opts.mode == "profile":  # observe (divisor 1) or reduce the batch: estimator_cli/reduced_batch.py
            from gpushare.estimator_cli.reduced_batch import install

            knob = install(max(1, opts.batch_divisor))
        from gpushare.estimator_cli.capture import ScriptRun, capture_fake, capture_profile
        from gpushare.estimator_cli.cuda_api import PresentedGpu
        from gpushare.estimator_cli.placeholders import DataDependent

        run = ScriptRun(opts.script, args, opts.steps, PresentedGpu(**json.loads(opts.gpu)),
                        _status_writer(opts.status, opts.steps), module=opts.module)
        loaded_before = set(sys.modules)
        try:
            if opts.mode == "fake":
                capture = capture_fake(run)
            else:
                with tempfile.TemporaryDirectory(prefix="gpu-estimate-trace-") as tmp:
                    capture = capture_profile(run, tmp)
            result["capture"] = capture.to_json()
            result["local_modules"] = local_modules(run.main_file(), loaded_before)
            from gpushare.estimator_cli.preload import framework_modules

            result["framework_modules"] = framework_modules(loaded_before)
        except DataDependent as exc:
            result.update(status="data_dependent", error=_error(exc, opts.script))
        except MemoryError as exc:
            result.update(status="limit", error=_error(exc, opts.script))
        except SystemExit as exc:
            result.update(status="script_error", error={"type": "SystemExit", "message":
                          f"the script exited with status {exc.code}", "traceback": ""})
        except (ImportError, OSError, SyntaxError) as exc:
            result.update(status="script_error", error=_error(exc, opts.script))
        except Exception as exc:  # the script's own failure, or fake mode's: the parent decides
            if isinstance(first_cause(exc), DataDependent):
                result.update(status="data_dependent", error=_error(exc, opts.script))
            elif _out_of_memory(first_cause(exc)) or _out_of_memory(exc):
                result.update(status="limit", error=_error(exc, opts.script))
            elif opts.mode == "fake" and _needs_values(exc):
                result.update(status="data_dependent", error=_error(exc, opts.script))
            else:
                result.update(status="fake_error" if opts.mode == "fake" else "script_error", error=_error(exc, opts.script))
    except BaseException as exc:  # noqa: BLE001 - anything else is still reported, never lost
        result.update(status="script_error", error=_error(exc, opts.script))
    if knob is not None:
        result["batch"] = knob.to_json()
    torch_module = sys.modules.get("torch")  # the versions the capture really ran with (--python: the user's)
    result["python_version"] = ".".join(str(v) for v in sys.version_info[:3])
    result["torch_version"] = str(getattr(torch_module, "__version__", "unknown"))
    sys.stdout.flush()
    sys.stderr.flush()
    with open(opts.out, "w", encoding="utf-8") as handle:
        # json.dumps, not json.dump: dump streams through the pure-Python encoder, 1.8 s instead of 0.5 s
        # for the 414,000 events of a 21-micro-step LoRA capture
        handle.write(json.dumps(result))
    os._exit(0)  # skip interpreter teardown: the script may have left threads and atexit handlers


if __name__ == "__main__":
    sys.exit(main())
