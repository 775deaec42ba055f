"""The estimate cache: same script bytes, arguments, environment, torch and targets → same estimate.

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
                "CUDA_MODULE_LOADING", "CUBLASLT_WORKSPACE_SIZE", "PYTORCH_NO_CUDA_MEMORY_CACHING")
# Version of the estimate's model (orchestrator, device model). Bump it when the same capture would give a
# different estimate, so entries made by an older model are not served as current. 2: cuDNN workspaces
# from convolution geometry (estimator_cli/conv_workspace.py).
MODEL_VERSION = 2


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpushare" / "estimates"


def cache_key(script_bytes: bytes, args: list[str], env: dict[str, str], torch_version: str,
              targets: list[str], settings: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(hashlib.sha256(script_bytes).digest())
    h.update(json.dumps({"args": args, "env": {k: env.get(k, "") for k in RELEVANT_ENV},
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
    return doc if isinstance(doc, dict) and doc.get("cache_key") == key else None


def store(cache_dir: Path, key: str, doc: dict[str, Any]) -> None:
    try:
        write_json_atomic(cache_dir / f"{key}.json", doc)
    except OSError:
        pass  # a read-only or full cache must never fail an estimate
