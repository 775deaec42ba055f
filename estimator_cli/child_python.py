"""A Python program that starts its training script as a child Python process: the child runs in the capture.

Why: some commands are launchers written in Python. ``trl sft ...`` (TRL's command line) hands its
arguments to accelerate's ``launch_command``, whose ``simple_launcher`` starts ``python trl/scripts/sft.py
...`` with ``subprocess.Popen`` and waits for it; a Python entry point may do the same by hand. The child is
a new interpreter without the capture (no presented GPU, no fake CUDA), so it failed on the CPU build and the
estimate saw only "returned non-zero exit status 1". While the script runs, a ``Popen`` of this very
interpreter on a script file (``python SCRIPT ARGS``) or a module (``python -m MODULE ARGS``) runs that
program here instead, as ``__main__``, with the child's arguments, environment and ``sys.path[0]``; the
object returned answers ``wait``/``poll``/``communicate`` with its exit status. Exceptions other than
``SystemExit`` propagate, so the child's own error (or the capture's stop after the requested steps) reaches
the capture as if the script had raised it. Any other command (a different interpreter, ``python -c``, a
program that is not Python) starts as a real process.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import subprocess
import sys
from typing import Any, Iterator, Sequence

_PYTHON_FLAGS = {"-u", "-B", "-O", "-OO", "-s", "-E", "-q"}  # flags a launcher may put before the script


def _same_interpreter(exe: str) -> bool:
    try:
        return os.path.realpath(exe) == os.path.realpath(sys.executable) or \
            os.path.samefile(exe, sys.executable)
    except OSError:
        return False


def python_child(argv: Any) -> tuple[str, str, list[str]] | None:
    """("path", SCRIPT, ARGS) or ("module", NAME, ARGS) when ``argv`` runs this interpreter on a script
    file or a module, else None."""
    if isinstance(argv, (str, bytes)) or not isinstance(argv, Sequence) or len(argv) < 2:
        return None
    words = [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else a for a in argv]
    if not all(isinstance(w, str) for w in words) or not _same_interpreter(words[0]):
        return None
    i = 1
    while i < len(words) and words[i] in _PYTHON_FLAGS:
        i += 1
    if i >= len(words):
        return None
    if words[i] == "-m" and i + 1 < len(words):
        return "module", words[i + 1], words[i + 2:]
    if words[i].startswith("-") or not words[i].endswith(".py") or not os.path.isfile(words[i]):
        return None
    return "path", words[i], words[i + 1:]


class InProcessChild:
    """What ``subprocess.Popen`` returns for a Python child run in this process (already finished)."""

    stdin = stdout = stderr = None

    def __init__(self, argv: Any, returncode: int) -> None:
        self.args = argv
        self.returncode = returncode
        self.pid = os.getpid()

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def poll(self) -> int:
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[None, None]:
        return None, None

    def send_signal(self, sig: int) -> None:
        pass

    terminate = kill = lambda self: None  # noqa: E731

    def __enter__(self) -> "InProcessChild":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def run_child(kind: str, target: str, args: list[str], env: dict[str, str] | None, cwd: Any) -> int:
    """Run the child program as ``__main__`` here; its exit status (SystemExit's code, 0 when it returns)."""
    saved_argv, saved_path0, saved_env, saved_cwd = sys.argv, sys.path[0] if sys.path else None, \
        dict(os.environ), os.getcwd()
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update({os.fsdecode(k): os.fsdecode(v) for k, v in env.items()})
        if cwd is not None:
            os.chdir(cwd)
        if kind == "module":
            sys.argv = [target, *args]
            if sys.path:
                sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            if sys.path:
                sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        return 0
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)


@contextlib.contextmanager
def python_children_in_process() -> Iterator[None]:
    real_popen = subprocess.Popen

    class Popen(real_popen):  # type: ignore[misc, valid-type]
        def __new__(cls, args: Any, *rest: Any, **kwargs: Any) -> Any:
            child = python_child(args)
            if child is None:
                return super().__new__(cls)
            kind, target, child_args = child
            return InProcessChild(args, run_child(kind, target, child_args, kwargs.get("env"), kwargs.get("cwd")))

    subprocess.Popen = Popen  # type: ignore[misc]
    try:
        yield
    finally:
        subprocess.Popen = real_popen  # type: ignore[misc]
