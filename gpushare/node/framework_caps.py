"""Framework memory caps merged with the user's own settings. Pure: environments in, exports out.

Why framework caps: MPS gives a hard limit only when every job on a GPU is one user's (NVIDIA serialises
MPS servers of different users), so a time-sliced shared job needs a cap its framework enforces on its
own allocations, with no change to the script:

- PyTorch: ``PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:F`` — the CUDA caching allocator refuses
  any allocation that would take the process's reserved memory past ``F`` × the device memory, and raises
  its ordinary ``torch.OutOfMemoryError`` in the offender, never in the neighbour. Recent PyTorch also reads
  ``PYTORCH_ALLOC_CONF`` and prefers it; when the user set that one, it is merged and exported too.
- JAX: ``XLA_PYTHON_CLIENT_MEM_FRACTION=F`` and ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (XLA would
  otherwise reserve 75 % of the device at start-up, whatever the job needs).

Merging: the user's other allocator keys are kept as written (the value is split on top-level commas
only, so ``roundup_power2_divisions:[256:1,512:2]`` survives); a fraction the user set is kept when it is
stricter (smaller) than ours, otherwise ours replaces it. A user value we cannot read safely (characters
outside the allowed set, unbalanced brackets) is left alone and the cap is not added: the agent's
backstop still applies. ``F`` is a fraction of the device the job sees (the GPU, or its MIG slice).
"""

from __future__ import annotations

import re
from typing import Mapping

TORCH_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
FRACTION_KEY = "per_process_memory_fraction"
_SAFE_RE = re.compile(r"^[A-Za-z0-9_.:,>\[\]+-]{0,1024}$")


def fraction_text(fraction: float) -> str:
    """A fraction as exported: six decimals at most, no trailing zeros (``0.125``, ``0.028489``)."""
    text = f"{fraction:.6f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def split_top(text: str) -> list[str] | None:
    """``k:v`` items of an allocator setting, split on commas outside brackets; None when unbalanced."""
    items: list[str] = []
    depth = 0
    buf: list[str] = []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                return None
        if ch == "," and depth == 0:
            items.append("".join(buf))
            buf = []
        else:
            buf.append(ch)
    if depth:
        return None
    items.append("".join(buf))
    return [item.strip() for item in items if item.strip()]


def _fraction(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 <= value <= 1.0 else None


def merge_alloc_conf(user: str | None, fraction: float) -> str | None:
    """The user's allocator setting with ``per_process_memory_fraction`` at most ``fraction``.

    None when the user's value cannot be merged safely (then nothing is exported for it).
    """
    ours = f"{FRACTION_KEY}:{fraction_text(fraction)}"
    if not user or not user.strip():
        return ours
    if not _SAFE_RE.match(user):
        return None
    items = split_top(user)
    if items is None:
        return None
    kept, strictest = [], fraction
    for item in items:
        key, _, value = item.partition(":")
        if key.strip() == FRACTION_KEY:
            theirs = _fraction(value.strip())
            if theirs is not None:
                strictest = min(strictest, theirs)
            continue  # replaced by the merged key below (a malformed one is replaced by ours)
        kept.append(item)
    kept.append(f"{FRACTION_KEY}:{fraction_text(strictest)}")
    return ",".join(kept)


def merged_exports(user_env: Mapping[str, str], fraction: float | None) -> dict[str, str]:
    """Framework caps for a job whose memory share is ``fraction`` of its device, merged with ``user_env``."""
    if fraction is None or not 0.0 < fraction <= 1.0:
        return {}
    out: dict[str, str] = {}
    for name in TORCH_VARS:
        if name == "PYTORCH_CUDA_ALLOC_CONF" or user_env.get(name):
            merged = merge_alloc_conf(user_env.get(name), fraction)
            if merged is not None:
                out[name] = merged
    theirs = _fraction(user_env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "").strip())
    out["XLA_PYTHON_CLIENT_MEM_FRACTION"] = fraction_text(min(fraction, theirs) if theirs is not None else fraction)
    out["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return out
