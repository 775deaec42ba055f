"""An estimation job's result, carried to the controller in the job's own Comment field.

Why the Comment: the estimation job runs as the user on a CPU node, the service that reads its result runs as
root on the controller, and the two hosts share no file system at most sites (homes are root-squashed, /tmp and
/var are each host's own). Slurm already carries a job's Comment from any host to the controller, authenticated
by munge, and lets a job's owner set it while the job runs. So the job's last step (``main``, run as the user on
the node) condenses gpu-estimate's output into one short line and sets it; the service (``parse``, as root)
reads it from squeue and checks every field, since the user can write anything there. That grants the user
nothing new: the estimate always came from their own code running as them. See docs/submit-path.md.

Format (docs/formats.md): ``gpushare-estimate:{json}`` with ``v`` 1, ``exit`` (gpu-estimate's status, or 90/91
from the wrapper), on success ``bytes`` and ``gpu`` (the peak for the first cluster GPU the document covers)
and ``python`` (the interpreter block), otherwise ``env_line``/``env_failed`` (replayed batch-script lines) and
``python_error`` (gpu-estimate's one line about ``--python``). At most :data:`MAX_CHARS` characters.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

PREFIX = "gpushare-estimate:"
VERSION = 1
MAX_CHARS = 1000  # well within what Slurm stores for a comment on every supported release
MAX_DOCUMENT_BYTES = 4 << 20
_PYTHON_ERROR_RE = re.compile(r"^gpu-estimate: (--python [\x20-\x7e]{1,200})$", re.MULTILINE)
_TEXT_RE = re.compile(r"^[\x20-\x7e]{0,200}$")


def _read(path: Path, limit: int) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(limit + 1)
    except OSError:
        return b""


def _first_number(path: Path) -> int | None:
    words = _read(path, 4096).split()
    return int(words[0]) if words and words[0].isdigit() and len(words[0]) < 8 else None


def condense(directory: Path, code: int, gpus: list[str]) -> dict[str, Any]:
    """The result of the run whose files are in ``directory`` (this job's own), as the Comment carries it."""
    from gpushare.estimate.source import EstimateUnavailable, peak_total_from_json

    result: dict[str, Any] = {"v": VERSION, "exit": code}
    for name in ("env_line", "env_failed"):  # a replayed line may fail without ending the shell
        number = _first_number(directory / name)
        if number is not None:
            result[name] = number
    if code == 0:
        raw = _read(directory / "result.json", MAX_DOCUMENT_BYTES)
        try:
            document = json.loads(raw)
            total, gpu = peak_total_from_json(document, gpus)
        except (ValueError, EstimateUnavailable) as exc:
            result["error"] = str(exc).rsplit(": ", 1)[-1][:80]
            return result
        result.update(bytes=int(total), gpu=gpu)
        python = document.get("python") if isinstance(document, dict) else None
        if isinstance(python, dict):
            result["python"] = {k: python[k] for k in ("executable", "python_version", "torch_version")
                                if isinstance(python.get(k), str) and len(python[k]) <= 200}
        return result
    if code == 2:
        match = _PYTHON_ERROR_RE.search(_read(directory / "stderr.txt", 65536).decode("utf-8", "replace"))
        if match:
            result["python_error"] = match.group(1)[:160]
    return result


def render(result: dict[str, Any]) -> str:
    text = PREFIX + json.dumps(result, separators=(",", ":"), sort_keys=True)
    if len(text) > MAX_CHARS:  # only the python block can be long: the estimate itself always fits
        text = PREFIX + json.dumps({k: v for k, v in result.items() if k != "python"}, separators=(",", ":"),
                                   sort_keys=True)
    return text


def parse(comment: str) -> dict[str, Any] | None:
    """A Comment as the service reads it (written by the user's job: every field checked), or None."""
    if not comment.startswith(PREFIX) or len(comment) > MAX_CHARS:
        return None
    try:
        data = json.loads(comment[len(PREFIX):])
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("v") != VERSION:
        return None
    clean: dict[str, Any] = {}
    for key in ("exit", "bytes", "env_line", "env_failed"):
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 53:
            clean[key] = value
    for key in ("gpu", "python_error", "error"):
        value = data.get(key)
        if isinstance(value, str) and _TEXT_RE.match(value):
            clean[key] = value
    python = data.get("python")
    if isinstance(python, dict):
        clean["python"] = {k: v for k, v in python.items() if k in ("executable", "python_version", "torch_version")
                           and isinstance(v, str) and _TEXT_RE.match(v)}
    return clean if "exit" in clean else None


def main(argv: list[str] | None = None) -> int:
    """``python -m gpushare.slurm_plugins.estimation_result DIR EXIT GPU...``, the estimation job's last step."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or not args[1].isdigit():
        print("usage: estimation_result DIR EXIT GPU...", file=sys.stderr)
        return 2
    text = render(condense(Path(args[0]), int(args[1]), args[2:]))
    print(text)
    job = os.environ.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        print("estimation_result: not inside a Slurm job (no SLURM_JOB_ID); nothing sent", file=sys.stderr)
        return 1
    done = subprocess.run(["scontrol", "update", f"jobid={job}", f"comment={text}"], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"estimation_result: scontrol update refused: {done.stderr.strip()[:200]}", file=sys.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
