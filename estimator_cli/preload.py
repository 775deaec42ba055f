"""Learned preloads for the warm worker: the training frameworks the user's scripts import.

Why: with torch already imported by the warm worker, most of what is left of an estimate of a Hugging
Face, Lightning or diffusers script is importing that framework in the capture child (transformers'
model modules, accelerate, Lightning: 3–8 s on a 2-core login node, every time). The capture child reports
which modules of a known set of frameworks the script imported; ``gpu-estimate`` writes them next to the
worker's socket (a private directory, estimator_cli/warm_worker.py), and the idle worker imports them, so
the next capture is forked with them loaded. Only the frameworks listed here, whose import has no side
effects that a fork would break (no threads, no CUDA, no device queries at import time), are learned;
anything else is imported by the child as before. A list that stops importing is ignored.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

FRAMEWORKS = ("transformers", "accelerate", "lightning", "lightning_fabric", "pytorch_lightning", "diffusers",
              "timm", "torchmetrics", "torch_geometric", "einops", "safetensors", "huggingface_hub", "PIL")
MAX_MODULES = 2000


def framework_modules(already: set[str]) -> list[str]:
    """Modules of ``FRAMEWORKS`` imported since ``already`` (the capture child's modules before the script)."""
    found = [name for name in list(sys.modules) if name not in already
             and name.split(".")[0] in FRAMEWORKS and sys.modules.get(name) is not None]
    return sorted(found)[:MAX_MODULES]


def preload_file(socket_path: Path) -> Path:
    return socket_path.with_suffix(".preload")


def remember(socket_path: Path, modules: list[str]) -> None:
    """Merge ``modules`` into the worker's preload list (atomically; best effort)."""
    if not modules:
        return
    path = preload_file(socket_path)
    known = set(_read(path))
    if set(modules) <= known:
        return
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(sorted(known | set(modules))[:MAX_MODULES]), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def load_remembered(socket_path: Path, state: dict[str, int]) -> int:
    """In the idle worker: import the listed modules once the list changed; returns how many were new."""
    path = preload_file(socket_path)
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        return 0
    if state.get("stamp") == stamp:
        return 0
    state["stamp"] = stamp
    loaded = 0
    for name in _read(path):
        if name in sys.modules or name.split(".")[0] not in FRAMEWORKS:
            continue
        try:
            importlib.import_module(name)
            loaded += 1
        except Exception:  # noqa: BLE001 - a module that does not import here is left to the child
            continue
    return loaded


def _read(path: Path) -> list[str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [x for x in data if isinstance(x, str)] if isinstance(data, list) else []
