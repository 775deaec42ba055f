"""``gpushare-task-prolog``: Slurm's TaskProlog (the job's user, inside the job's environment).

Its stdout shapes the job's environment (``export K=V``): it exports the caps the Prolog left for this
job (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``,
``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_VISIBLE_DEVICES=0`` under MPS, ``GPUSHARE_MEMORY_FRACTION``).
Only known names are exported and only values made of safe characters; printing nothing leaves the job
as it is, which is what happens on any error here.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Mapping, TextIO

_VALUE_RE = re.compile(r"^[A-Za-z0-9_./,:=%+-]{1,512}$")
_JOB_RE = re.compile(r"^\d{1,10}$")


def exports(env: Mapping[str, str], run_dir: str) -> list[str]:
    """The ``export`` lines for this task's job (empty when it has no caps file)."""
    from gpushare.agent.caps import EXPORTABLE
    from gpushare.prolog.slurmd_prolog import CAPS_VERSION, caps_path

    job = env.get("SLURM_JOB_ID", "")
    if not _JOB_RE.match(job):
        return []
    try:
        with open(caps_path(run_dir, job), "rb") as handle:
            data = json.loads(handle.read(65536))
    except (OSError, ValueError):
        return []
    ours = isinstance(data, dict) and str(data.get("job")) == job and data.get("v", CAPS_VERSION) == CAPS_VERSION
    values = data.get("env") if ours else None
    if not isinstance(values, dict):
        return []
    return [f"export {key}={values[key]}" for key in EXPORTABLE
            if isinstance(values.get(key), str) and _VALUE_RE.match(values[key])]


def main(argv: list[str] | None = None, out: TextIO = sys.stdout) -> int:
    try:
        from gpushare.config import load_config

        lines = exports(os.environ, load_config().agent.run_dir)
        if lines:
            out.write("\n".join(lines) + "\n")
            out.flush()
    except Exception as exc:  # noqa: BLE001 - the job runs unchanged
        sys.stderr.write(f"gpushare-task-prolog: {exc.__class__.__name__}: {exc}; job environment unchanged\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
