"""An explicit memory guard for shared jobs that run without MPS limits (time-sliced beside other users).

The TaskProlog exports ``GPUSHARE_MEMORY_FRACTION`` (estimate + margin over the GPU's memory) and, for
these jobs, already sets PyTorch's own cap through the environment (``PYTORCH_CUDA_ALLOC_CONF``'s
``per_process_memory_fraction``, merged with the user's settings: ``gpushare.node.framework_caps``), so
an unmodified script is capped. This module is for scripts that want the fraction set explicitly (a
PyTorch older than that key, or a script that rewrites the allocator setting), with one line at the top
of its script::

    import gpushare.prolog.memory_guard; gpushare.prolog.memory_guard.apply()

which calls ``torch.cuda.set_per_process_memory_fraction`` on every visible device: PyTorch's caching
allocator then raises its usual OOM error when the job outgrows its share, instead of taking memory
its neighbours were promised. Soft: allocations outside PyTorch's allocator (cuDNN workspaces, NCCL,
other frameworks) are not limited. Without the variable, or without CUDA, it does nothing.
"""

from __future__ import annotations

import os


def fraction(env: dict[str, str] | None = None) -> float | None:
    """The fraction the TaskProlog exported, or None (absent or not a number in (0, 1])."""
    text = (env if env is not None else os.environ).get("GPUSHARE_MEMORY_FRACTION", "")
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 < value <= 1.0 else None


def apply() -> float | None:
    """Cap PyTorch's allocator on every visible GPU; returns the fraction applied (None: nothing done)."""
    value = fraction()
    if value is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    for device in range(torch.cuda.device_count()):
        torch.cuda.set_per_process_memory_fraction(value, device)
    return value
