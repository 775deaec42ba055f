"""The estimate cache: same script bytes, arguments, environment, torch and targets → same estimate.

What the script reads besides its own bytes counts too: an argument naming a regular file (``--config
cfg.yaml``, ``--config=cfg.yaml``; up to ``MAX_ARG_FILE_BYTES``) enters the key with its contents, and
the modules the script imported from its own project (``dependencies`` in the document, found by the
child, estimator_cli/runner.py) are re-hashed on every hit — a changed or missing one is a miss.

Users' default is ``$XDG_CACHE_HOME/gpushare/estimates`` (``~/.cache/gpushare/estimates``); the cluster's
asynchronous path points ``--cache-dir`` at ``[submit] cache_dir`` (gpushare/config.py). Entries are
written atomically (gpushare/atomic.py), so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from gpushare.atomic import write_json_atomic

# Environment that changes what the GPU run allocates (allocator behaviour, cuBLAS workspace, lazy loading).
RELEVANT_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG",
                "CUDA_MODULE_LOADING", "CUBLASLT_WORKSPACE_SIZE", "PYTORCH_NO_CUDA_MEMORY_CACHING",
                "TORCH_CUBLASLT_UNIFIED_WORKSPACE")
# Version of the estimate's model (orchestrator, device model). Bump it when the same capture would give a
# different estimate, so entries made by an older model are not served as current. 2: cuDNN workspaces
# from convolution geometry (estimator_cli/conv_workspace.py). 4: documents carry the persistent/ephemeral
# split (estimator_cli/persistent.py), which an older entry lacks. 5: fake mode answers host copies of GPU
# values and fast-forwards repeated passes, so a script that fell back to profile mode before is captured
# in fake mode now (estimator_cli/value_use.py, repeat_passes.py). 6: CUDA reductions' staging buffers
# (estimator_cli/reduce_buffer.py). 7: the cuBLASLt workspace kept after the first addmm (device_model.py).
# 8: half-precision convolutions get no FFT workspace (conv_workspace.py); an accumulating job's capture
# stops at its first repeated micro-step after step 1 (phases.py). 9: that stop also waits until the micro-steps
# after step 1 have risen as far as the first window's worst (an entry made under 8 may be low). 10: less than a
# small-pool segment short of that worst counts as as far (phases.RISE_SLACK); an in-place write that returns
# nothing (``x[i] = v``) reaches the value the capture keeps of a small tensor (concrete_values.py). 11: tensors
# up to 16M elements keep their values (a read that took a placeholder may now take the real value).
MODEL_VERSION = 11


MAX_ARG_FILE_BYTES = 4 << 20


def file_digest(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError:
        return None


def _argument_files(args: list[str]) -> dict[str, str]:
    """sha256 of every argument (or ``--opt=value`` value) that names a regular file of modest size."""
    found: dict[str, str] = {}
    for arg in args:
        for candidate in {arg, arg.partition("=")[2]} - {""}:
            try:
                info = os.stat(candidate)
            except (OSError, ValueError):
                continue
            if os.path.isfile(candidate) and info.st_size <= MAX_ARG_FILE_BYTES:
                digest = file_digest(candidate)
                if digest is not None:
                    found[candidate] = digest
    return found


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpushare" / "estimates"


def cache_key(script_bytes: bytes, args: list[str], env: dict[str, str], torch_version: str,
              targets: list[str], settings: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(hashlib.sha256(script_bytes).digest())
    h.update(json.dumps({"args": args, "arg_files": _argument_files(args),
                         "env": {k: env.get(k, "") for k in RELEVANT_ENV},
                         "torch": torch_version, "targets": targets, "settings": settings,
                         "model": MODEL_VERSION},
                        sort_keys=True).encode())
    return h.hexdigest()


def load(cache_dir: Path, key: str) -> dict[str, Any] | None:
    try:
        with open(cache_dir / f"{key}.json", encoding="utf-8") as handle:
            doc = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("cache_key") != key:
        return None
    for dep in doc.get("dependencies") or []:  # the script's own modules, as they were when estimated
        if not isinstance(dep, dict) or file_digest(str(dep.get("path"))) != dep.get("sha256"):
            return None
    return doc


def store(cache_dir: Path, key: str, doc: dict[str, Any]) -> None:
    try:
        write_json_atomic(cache_dir / f"{key}.json", doc)
    except OSError:
        pass  # a read-only or full cache must never fail an estimate
