"""The interpreter a capture runs under: gpu-estimate's own, or the user's (``--python``).

Why: a researcher's script imports what their own environment holds (a venv, a conda environment, a
module's PyTorch), not what gpushare's environment holds. ``--python`` runs the capture child
(estimator_cli/runner.py) under that interpreter with nothing installed into it: the child's ``PYTHONPATH``
gets one private directory that holds only the capture code (``gpushare/estimator_cli`` and
``gpushare/errors.py``, linked from this installation), and the child talks to the parent over the same
argument and result-file protocol as the parent's own child.

Stdlib only: the child imports this module under the user's interpreter to check its own versions.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from gpushare.errors import GpushareError

# The range the capture code is written and tested for (docs/estimator.md, "Your own environment").
# Python: the package's own floor (3.11) up to the newest the chroots carry (3.13); PyTorch: the fake-mode
# and device-presenter APIs the capture patches exist from 2.4 on, and the newest released is 2.15.
PYTHON_RANGE = ((3, 11), (3, 13))
TORCH_RANGE = ((2, 4), (2, 15))
PROBE_TIMEOUT_S = 60.0

# Runs under any Python 3 (even one outside the range, so that the refusal can name its version): no
# f-strings, nothing imported that older interpreters lack. Finds torch without importing it (seconds).
_PROBE = """
import json, sys
try:
    from importlib import metadata
    torch = metadata.version("torch")
except Exception:
    torch = None
if torch is None:
    try:
        import importlib.util
        torch = "unknown" if importlib.util.find_spec("torch") is not None else None
    except Exception:
        pass
print(json.dumps({"executable": sys.executable, "python": list(sys.version_info[:3]), "prefix": sys.prefix,
                  "torch": torch}))
"""


class InterpreterError(GpushareError, ValueError):
    """The interpreter cannot run the capture; the message is one line naming it and why."""


@dataclass(frozen=True)
class Interpreter:
    """A Python interpreter the capture child can run under, with what it was checked to hold."""

    path: str  # as it will be executed (a venv's bin/python keeps its path: resolving it loses the venv)
    python_version: str  # "3.11.2"
    torch_version: str  # "2.13.0+cpu", or "unknown" (torch found without package metadata)
    prefix: str  # sys.prefix: which environment
    own: bool = False  # gpu-estimate's own interpreter

    def to_json(self) -> dict[str, object]:
        return {"executable": self.path, "python_version": self.python_version, "torch_version": self.torch_version,
                "prefix": self.prefix, "own": self.own}


def own() -> Interpreter:
    """gpu-estimate's own interpreter (no probe: this process is it)."""
    from importlib import metadata

    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "unknown"
    return Interpreter(sys.executable, ".".join(str(v) for v in sys.version_info[:3]), torch, sys.prefix, own=True)


def resolve(name: str, search_path: str | None = None) -> str:
    """The interpreter ``name`` stands for: a path, or a command looked up on PATH, the way the shell would;
    a script (``torchrun``, ``accelerate``, a training script with a ``#!`` line) stands for the Python its
    first line names."""
    found = name if "/" in name else shutil.which(name, path=search_path)
    if not found or not os.path.isfile(found):
        raise InterpreterError(f"--python {name}: no such file" + ("" if "/" in name else " on PATH"))
    if not os.access(found, os.X_OK):
        raise InterpreterError(f"--python {name}: {found} is not executable")
    target = _shebang_interpreter(found, search_path)
    return os.path.abspath(target or found)


def _shebang_interpreter(path: str, search_path: str | None) -> str | None:
    """The interpreter named by a script's first line (``#!/venv/bin/python``, ``#!/usr/bin/env python3``, or
    pip's ``#!/bin/sh`` + ``'''exec' /long/path/python`` form), or None for a binary."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(1024)
    except OSError as exc:
        raise InterpreterError(f"--python {path}: cannot read it: {exc.strerror}") from exc
    if not head.startswith(b"#!"):
        return None
    lines = head.decode("utf-8", "replace").splitlines()
    words = lines[0][2:].split()
    if words and words[0].endswith("/sh") and len(lines) > 1:
        match = re.match(r"^'''exec' (?:\"([^\"]+)\"|(\S+))", lines[1])
        if match:
            return match.group(1) or match.group(2)
    if words and words[0].endswith("/env"):
        words = [w for w in words[1:] if not w.startswith("-")]
        if not words:
            raise InterpreterError(f"--python {path}: its first line names no interpreter")
        located = shutil.which(words[0], path=search_path)
        if not located:
            raise InterpreterError(f"--python {path}: its first line runs {words[0]}, which is not on PATH")
        words = [located]
    if not words or not re.search(r"python[0-9.]*$", os.path.basename(words[0])):
        raise InterpreterError(f"--python {path}: a script run by {words[0] if words else 'nothing'}, not by Python")
    return words[0]


def probe(path: str) -> Interpreter:
    """Ask the interpreter for its versions (a fraction of a second: torch is found, not imported) and
    check them against the supported range."""
    try:
        proc = subprocess.run([path, "-c", _PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, env=child_env(dict(os.environ)))
    except (OSError, subprocess.SubprocessError) as exc:
        raise InterpreterError(f"--python {path}: cannot run it: {exc}") from exc
    try:
        info = json.loads(proc.stdout.strip().splitlines()[-1])
        version = ".".join(str(int(v)) for v in info["python"])
    except (ValueError, IndexError, KeyError, TypeError):
        raise InterpreterError(f"--python {path}: not a Python 3 interpreter (it did not report its version; "
                               f"exit status {proc.returncode})") from None
    found = Interpreter(path, version, info.get("torch") or "", str(info.get("prefix") or ""))
    check(found)
    return found


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:2])


def check(found: Interpreter) -> None:
    """Refuse, in one line, an interpreter outside the supported range or without PyTorch."""
    low, high = PYTHON_RANGE
    if not low <= _numbers(found.python_version) <= high:
        raise InterpreterError(f"--python {found.path}: Python {found.python_version} is outside the supported "
                               f"range {_span(PYTHON_RANGE)}")
    if not found.torch_version:
        raise InterpreterError(f"--python {found.path}: PyTorch is not installed there (Python {found.python_version}, "
                               f"{found.prefix})")
    low, high = TORCH_RANGE
    if found.torch_version != "unknown" and not low <= _numbers(found.torch_version) <= high:
        raise InterpreterError(f"--python {found.path}: PyTorch {found.torch_version} is outside the supported "
                               f"range {_span(TORCH_RANGE)}")


def _span(bounds: tuple[tuple[int, int], tuple[int, int]]) -> str:
    return f"{bounds[0][0]}.{bounds[0][1]}–{bounds[1][0]}.{bounds[1][1]}"


def capture_path(root: str) -> str:
    """A directory under ``root`` holding only the capture code, for the child's ``PYTHONPATH``: a
    ``gpushare`` package with an empty ``__init__`` (the real one may grow imports the user's environment
    lacks), ``errors.py``, ``gpus.py`` (the GPU catalogue, standard library only: the reduction model reads
    its threads-per-SM figures) and ``estimator_cli`` linked from this installation."""
    package_dir = os.path.dirname(os.path.abspath(__file__))
    errors = os.path.abspath(sys.modules[GpushareError.__module__].__file__ or "")
    top = tempfile.mkdtemp(prefix="capture-path-", dir=root)
    os.mkdir(os.path.join(top, "gpushare"))
    with open(os.path.join(top, "gpushare", "__init__.py"), "w", encoding="utf-8") as handle:
        handle.write('"""Capture code only (gpu-estimate --python)."""\n')
    os.symlink(errors, os.path.join(top, "gpushare", "errors.py"))
    os.symlink(os.path.join(os.path.dirname(errors), "gpus.py"), os.path.join(top, "gpushare", "gpus.py"))
    os.symlink(package_dir, os.path.join(top, "gpushare", "estimator_cli"))
    return top


def runner_command(path_dir: str) -> str:
    """The child's ``-c`` program: the capture code's directory goes *before* the working directory on
    ``sys.path`` (``-m`` would put the working directory first, and a ``gpushare`` folder there, such as this
    repository's, would hide the capture code)."""
    return (f"import sys; sys.path.insert(0, {path_dir!r}); "
            "from gpushare.estimator_cli.runner import main; sys.exit(main())")


CHILD_PYTHONPATH = "GPUSHARE_CHILD_PYTHONPATH"  # the user's PYTHONPATH, kept away from gpu-estimate's own imports


def child_env(base: dict[str, str], path_dir: str = "") -> dict[str, str]:
    """The child's environment: the user's, with the capture code's directory first on PYTHONPATH. The
    cluster's estimation job hands the user's own PYTHONPATH over in ``GPUSHARE_CHILD_PYTHONPATH``."""
    env = dict(base)
    user = env.pop(CHILD_PYTHONPATH, None)
    user = env.get("PYTHONPATH", "") if user is None else user
    env.pop("PYTHONPATH", None)
    joined = os.pathsep.join(p for p in (path_dir, user) if p)
    if joined:
        env["PYTHONPATH"] = joined
    return env
