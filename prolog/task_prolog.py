"""``gpushare-task-prolog``: Slurm's TaskProlog (the job's user, inside the job's environment).

Its stdout shapes the job's environment (``export K=V``): it exports the caps the Prolog left for this
job (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``,
``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_VISIBLE_DEVICES=0`` under MPS, ``GPUSHARE_MEMORY_FRACTION``).
Only known names are exported and only values made of safe characters; printing nothing leaves the job
as it is, which is what happens on any error here.

A time-sliced shared job (``GPUSHARE_FRAMEWORK_CAPS=1`` in its caps) also gets its frameworks' own memory
caps, merged here because only this hook sees the user's environment: ``PYTORCH_CUDA_ALLOC_CONF`` gains
``per_process_memory_fraction`` (the user's other keys kept, a stricter fraction of theirs kept), and
JAX's ``XLA_PYTHON_CLIENT_MEM_FRACTION`` / ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
(``gpushare.node.framework_caps``).

A job the Prolog wrote hard cap limits for (``GPUSHARE_HARDCAP=1``, ``[agent] hardcap``;
``gpushare.node.hardcap``) gets ``LD_PRELOAD`` with the shim first and the user's own entries after it.

A lane job (``GPUSHARE_LANES=1``, docs/agent.md *Lanes*) gets ``PYTHONPATH`` with the package's
``lane_site`` directory first and the user's own entries after it (merged, never replaced).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Mapping, TextIO

_VALUE_RE = re.compile(r"^[A-Za-z0-9_./,:=%+-]{1,512}$")
_ALLOC_RE = re.compile(r"^[A-Za-z0-9_.,:>\[\]+-]{1,1024}$")  # allocator settings: brackets allowed
_JOB_RE = re.compile(r"^\d{1,10}$")
_PATH_RE = re.compile(r"^[A-Za-z0-9_./:+@-]{1,4096}$")  # PYTHONPATH: paths may be longer than other values


def exports(env: Mapping[str, str], run_dir: str, hardcap_library: str = "") -> list[str]:
    """The ``export`` lines for this task's job (empty when it has no caps file)."""
    from gpushare.node.caps import EXPORTABLE
    from gpushare.node.caps import CAPS_VERSION, caps_path

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
    lines = [f"export {key}={values[key]}" for key in EXPORTABLE
             if isinstance(values.get(key), str) and _VALUE_RE.match(values[key])]
    if values.get("GPUSHARE_FRAMEWORK_CAPS") == "1":
        lines += framework_lines(env, values.get("GPUSHARE_MEMORY_FRACTION"))
    if values.get("GPUSHARE_LANES") == "1":
        lines += lane_lines(env)
    if values.get("GPUSHARE_HARDCAP") == "1" and hardcap_library:
        from gpushare.node.hardcap import preload_line

        lines += preload_line(env, hardcap_library)
    return lines


def lane_site_dir() -> str:
    """The directory with the ``sitecustomize.py`` of lane jobs (shipped in the package)."""
    from pathlib import Path

    import gpushare.node

    return str(Path(gpushare.node.__file__).resolve().parent / "lane_site")


def lane_lines(env: Mapping[str, str]) -> list[str]:
    """``PYTHONPATH`` with the lanes ``sitecustomize`` first, the user's own entries kept after it.

    A user value this hook cannot pass through safely (characters outside the safe set) leaves the job
    without lanes rather than with a mangled ``PYTHONPATH``."""
    site = lane_site_dir()
    user = env.get("PYTHONPATH", "")
    parts = [site] + [p for p in user.split(":") if p and p != site]
    value = ":".join(parts)
    if not _PATH_RE.match(value):
        sys.stderr.write("gpushare-task-prolog: PYTHONPATH has characters that cannot be passed on; "
                         "lanes are off for this job\n")
        return ["export GPUSHARE_LANES=0"]
    return [f"export PYTHONPATH={value}"]


def framework_lines(env: Mapping[str, str], fraction_text: object) -> list[str]:
    """``export`` lines of the framework caps for a job with memory share ``fraction_text``."""
    from gpushare.node.caps import FRAMEWORK_EXPORTS
    from gpushare.node.framework_caps import merged_exports

    try:
        fraction = float(str(fraction_text))
    except ValueError:
        return []
    merged = merged_exports(env, fraction)
    return [f"export {key}={merged[key]}" for key in FRAMEWORK_EXPORTS
            if key in merged and _ALLOC_RE.match(merged[key])]


def main(argv: list[str] | None = None, out: TextIO = sys.stdout) -> int:
    try:
        from gpushare.config import load_config
        from gpushare.hooks import no_file_line

        cfg = load_config(warn=False)
        if not cfg.from_file:  # the job's environment stays as it is (gpushare.hooks.no_file_line: why)
            sys.stderr.write(no_file_line("gpushare-task-prolog", cfg) + "\n")
            return 0
        agent = cfg.agent
        lines = exports(os.environ, agent.run_dir, agent.hardcap_library)
        if lines:
            out.write("\n".join(lines) + "\n")
            out.flush()
    except Exception as exc:  # noqa: BLE001 - the job runs unchanged
        sys.stderr.write(f"gpushare-task-prolog: {exc.__class__.__name__}: {exc}; job environment unchanged\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
