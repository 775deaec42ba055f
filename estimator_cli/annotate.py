"""``gpu-estimate --annotate SCRIPT ARGS… -- [SBATCH OPTIONS] train.sbatch``: estimate, then submit with it.

Why a copy of the batch script with a directive: the batch script is what reaches the job_submit hook on the
controller, so the estimate travels in it as a ``#GPUSHARE est=<gpu>/<total>[/<persistent>/<ephemeral>],…``
line (gpushare/estimate/directives.py). A file path would not do: the controller's root cannot read homes that are
root-squashed, 0700 or not mounted there. Users cannot write the cluster's by-script cache (root's) either. So
an annotated copy of the batch script goes into ``.gpushare/`` beside the batch script, with the full estimate
JSON for the user's own reading, and ``sbatch`` gets the copy (same file name, so the job name is unchanged).
A second run with the same script, arguments and environment hits gpu-estimate's own cache and submits at once.

The batch script is found after ``--`` as the first argument naming an existing file (sbatch options may
come before it, the batch script's own arguments after it), or given with ``--sbatch FILE``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpushare.errors import GpushareError
from gpushare.atomic import write_text_atomic
from gpushare.estimate.schema import inline_value

ANNOTATION_DIR = ".gpushare"
_ESTIMATE_DIRECTIVE_RE = re.compile(r"^\s*#\s*GPUSHARE\b.*\b(mem|est|estimate)=", re.IGNORECASE)


class AnnotateError(GpushareError, ValueError):
    """A usage problem, phrased for the user (the CLI maps it to exit code 2)."""


@dataclass(frozen=True)
class Submission:
    script_args: list[str]  # what the training script gets
    sbatch_argv: list[str]  # sbatch options, the batch script, its arguments
    batch_index: int  # position of the batch script in sbatch_argv


def split_args(script_args: Sequence[str], sbatch_file: str | None) -> Submission:
    """Separate the training script's arguments from the sbatch part (``-- … train.sbatch``)."""
    args = list(script_args)
    if sbatch_file:
        return Submission(args, [sbatch_file], 0)
    if "--" not in args:
        raise AnnotateError("--annotate needs the batch script: gpu-estimate --annotate train.py ARGS -- "
                            "train.sbatch (or --sbatch train.sbatch)")
    cut = len(args) - 1 - args[::-1].index("--")
    sbatch_argv = args[cut + 1:]
    for index, word in enumerate(sbatch_argv):
        if not word.startswith("-") and Path(word).is_file():
            return Submission(args[:cut], sbatch_argv, index)
    raise AnnotateError(f"no batch script among {' '.join(sbatch_argv)[:120]!r} after '--'")


def annotate_script(text: str, doc: dict[str, Any], estimate_path: Path) -> str:
    """The batch script with ``#GPUSHARE est=…`` (the estimate itself) after its first line, before any
    command; the comment names the JSON kept beside it for the user."""
    for number, line in enumerate(text.splitlines(), start=1):
        if _ESTIMATE_DIRECTIVE_RE.match(line):
            raise AnnotateError(f"the batch script already names an estimate on line {number}; remove that "
                                "line or submit it without --annotate")
    value = inline_value([t for t in doc.get("targets", []) if isinstance(t, dict)])
    if not value:
        raise AnnotateError("the estimate has no GPU result to attach")
    directive = f"#GPUSHARE est={value}  # gpu-estimate --annotate; details in {estimate_path.name}\n"
    if text.startswith("#!"):
        first, _, rest = text.partition("\n")
        return f"{first}\n{directive}{rest}"
    return directive + text


def write_annotation(doc: dict[str, Any], batch_path: Path) -> tuple[Path, Path]:
    """Write the estimate JSON and the annotated copy into ``.gpushare/`` beside the batch script."""
    directory = batch_path.resolve().parent / ANNOTATION_DIR
    directory.mkdir(mode=0o755, exist_ok=True)
    estimate_path = directory / f"{batch_path.name}.estimate.json"
    write_text_atomic(estimate_path, json.dumps(doc, indent=1) + "\n")
    try:
        text = batch_path.read_text(encoding="utf-8", errors="surrogateescape")
    except OSError as exc:
        raise AnnotateError(f"cannot read {batch_path}: {exc.strerror}") from exc
    copy = directory / batch_path.name
    write_text_atomic(copy, annotate_script(text, doc, estimate_path))
    os.chmod(copy, 0o755)
    return estimate_path, copy


def summary(doc: dict[str, Any]) -> str:
    rows = [t for t in doc.get("targets", []) if isinstance(t, dict)]
    parts = [f"{t.get('gpu')}: {t.get('peak_total_bytes', 0) / (1 << 30):.2f} GiB" for t in rows]
    cached = " (cached)" if doc.get("cached") else ""
    return f"gpu-estimate: peak {', '.join(parts) or '?'}{cached}"


def submit(doc: dict[str, Any], submission: Submission,
           run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> int:
    """Attach the estimate and run sbatch; returns sbatch's exit code (2 for our own usage errors)."""
    batch_path = Path(submission.sbatch_argv[submission.batch_index])
    try:
        estimate_path, copy = write_annotation(doc, batch_path)
    except AnnotateError as exc:
        print(f"gpu-estimate: {exc}", file=sys.stderr)
        return 2
    argv = list(submission.sbatch_argv)
    argv[submission.batch_index] = str(copy)
    print(f"{summary(doc)}; estimate in {estimate_path}", file=sys.stderr)
    try:
        proc = run(["sbatch", *argv], capture_output=True, text=True)
    except OSError as exc:
        print(f"gpu-estimate: cannot run sbatch: {exc.strerror} (is slurm-client installed?)", file=sys.stderr)
        return 2
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    return proc.returncode
