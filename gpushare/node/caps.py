"""Per-job caps for shared GPU jobs and the environment the TaskProlog exports for them. Pure.

Why these caps (docs/architecture.md): Slurm's shard accounting keeps the *requests* on a GPU within its memory,
but nothing stops a job from using more than it asked for. Under MPS, ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
= estimate + margin makes a job that outgrows its estimate fail alone instead of OOM-ing its neighbours.

Different users (the policy option ``[agent] collocation``): MPS runs one server per UID and NVIDIA
serialises servers of different users on a GPU — a second user's job would sit waiting until the first
user's jobs leave. So:

``mps-same-user`` (default)  MPS only when every job already on the job's GPU belongs to the same user
                             and runs under MPS; otherwise this job is time-sliced beside them with the
                             framework caps (below). Nobody waits on another user's MPS server.
``mps``                      MPS always (a site that accepts cross-user serialisation, or one user).
``fraction``                 never MPS: time-slicing plus the framework caps for everyone.
``none``                     no caps at all (only Slurm's shard accounting).

The memory-fraction cap is ``GPUSHARE_MEMORY_FRACTION``: the job's need less what a PyTorch process holds
outside its caching allocator (CUDA context, library kernels: ``gpushare.cuda_context``), over the GPU's
memory. The need is a device-level figure (the estimate counts the context, like nvidia-smi and the backstop
do), while PyTorch's fraction bounds only the allocator: without the subtraction a job that stays inside its
framework cap would hold need + context (measured on an H200: 4.0 GiB cap + 0.6-0.75 GiB) and be stopped
by the backstop at need + tolerance. Six decimals: on a 141 GB GPU a third decimal is 140 MiB.
The TaskProlog turns it into
the frameworks' own settings, merged with the user's (``PYTORCH_CUDA_ALLOC_CONF``'s
``per_process_memory_fraction``, JAX's ``XLA_PYTHON_CLIENT_MEM_FRACTION``; ``gpushare.node.framework_caps``),
so an unmodified PyTorch or JAX script hits its own OOM. Allocations outside the framework's allocator
ignore it; the agent's backstop (``gpushare.agent.backstop``) covers those.

An MPS client sees devices *through its server*: our per-GPU daemon is started with
``CUDA_VISIBLE_DEVICES=<that GPU>``, so inside it the GPU is device 0 and the job must say
``CUDA_VISIBLE_DEVICES=0`` (Slurm's value names the physical GPU). Only single-GPU jobs use MPS: a client
attaches to one pipe directory, i.e. one GPU's daemon.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpushare.node.framework_caps import fraction_text
from gpushare.gpus import MiB
from gpushare.gres.mps import job_env
POLICIES = ("mps-same-user", "mps", "fraction", "none")
CAPS_VERSION = 1  # the caps file the Prolog writes and the TaskProlog reads (docs/formats.md)
MIN_ALLOCATOR_BYTES = 64 * MiB
# What the TaskProlog may export; anything else in a caps file is ignored.
EXPORTABLE = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
              "CUDA_VISIBLE_DEVICES", "GPUSHARE_MEMORY_FRACTION", "GPUSHARE_MEM_LIMIT_MIB", "GPUSHARE_CAPS_MODE",
              "GPUSHARE_FRAMEWORK_CAPS", "GPUSHARE_LANES", "GPUSHARE_LANE_SOCKET")
# Computed by the TaskProlog from GPUSHARE_MEMORY_FRACTION and the user's own environment (framework_caps.py)
FRAMEWORK_EXPORTS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                     "XLA_PYTHON_CLIENT_PREALLOCATE")


@dataclass(frozen=True)
class Caps:
    """What a job is limited to on its GPU."""

    mode: str  # "mps" | "fraction" | "none"
    mem_limit_mib: int | None = None  # estimate + margin, MiB; None without an estimate
    thread_percentage: int | None = None  # MPS only
    fraction: float | None = None  # (need - outside the allocator) / GPU memory: the framework caps' fraction
    reason: str = ""  # one line: why this mode

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Caps":
        """The inverse of :meth:`as_dict`. A field the record lacks keeps its default (``reason`` stays a
        string, not None); ``mode`` is required."""
        return cls(mode=str(data["mode"]), mem_limit_mib=data.get("mem_limit_mib"),
                   thread_percentage=data.get("thread_percentage"), fraction=data.get("fraction"),
                   reason=data.get("reason") or "")


def need_mib(est_gib: float | None, margin_gib: float | None, shards: int | None) -> int | None:
    """The job's memory need: the submit record's estimate + margin, or its shard grant (GiB) where that is larger.

    The grant wins when it is more than the estimate rounded up to whole shards: the job was given more on
    purpose (OOM recovery moved it to a whole GPU, or the user asked for more), and capping it at the old
    estimate would stop the rerun exactly where the first run stopped.
    """
    granted = int(shards) * 1024 if shards else None
    if est_gib is not None and est_gib > 0:
        need = max(1, math.ceil((est_gib + max(margin_gib or 0.0, 0.0)) * 1024))
        if granted is not None and granted > math.ceil(need / 1024) * 1024:
            return granted
        return need
    return granted


def allocator_fraction(allocator_bytes: float, gpu_total_bytes: int) -> float:
    """PyTorch's ``per_process_memory_fraction`` for an allocator share, rounded down to 1e-6 (never above
    the share) and at most 1. A share below ``MIN_ALLOCATOR_BYTES`` (a need smaller than the context) gets that
    much, so the job fails at its first real allocation rather than at CUDA start."""
    share = max(allocator_bytes, MIN_ALLOCATOR_BYTES) / gpu_total_bytes
    return max(1e-6, min(1.0, math.floor(share * 1e6) / 1e6))


def decide_caps(policy: str, *, shared: bool, gpus: int, uid: int, need: int | None, gpu_total_bytes: int,
                tenants: list[tuple[int, str]], thread_percentage: int = 100, outside_allocator_bytes: int = 0) -> Caps:
    """Caps of one job. ``tenants``: (uid, caps mode) of the other jobs already on its GPU;
    ``outside_allocator_bytes``: what its process holds outside PyTorch's allocator on that GPU."""
    if policy not in POLICIES:
        raise ValueError(f"unknown collocation policy {policy!r} (known: {', '.join(POLICIES)})")
    if not shared or policy == "none" or need is None:
        why = "not a shared job" if not shared else ("collocation = none" if policy == "none" else "no estimate")
        return Caps("none", reason=why)
    fraction = allocator_fraction(need * MiB - outside_allocator_bytes, gpu_total_bytes) if gpu_total_bytes else None
    soft = Caps("fraction", need, None, fraction, "")
    if policy == "fraction":
        return Caps(**{**soft.as_dict(), "reason": "collocation = fraction"})
    if gpus != 1:
        return Caps(**{**soft.as_dict(), "reason": "MPS clients attach to one GPU's daemon; job has several GPUs"})
    if policy == "mps-same-user":
        others = [t for t in tenants if t[0] != uid]
        if others:
            return Caps(**{**soft.as_dict(), "reason": f"another user (uid {others[0][0]}) is on this GPU: "
                                                      "time-sliced, not serialised behind their MPS server"})
        if any(mode != "mps" for _, mode in tenants):
            return Caps(**{**soft.as_dict(), "reason": "a job on this GPU runs outside MPS"})
    return Caps("mps", need, thread_percentage, fraction, f"collocation = {policy}")


def task_env(caps: Caps, pipe_dir: str | None, framework: bool = True) -> dict[str, str]:
    """Variables the TaskProlog exports for a job with these caps (strings, shell-safe).

    ``framework``: a time-sliced (``fraction``) job is also marked ``GPUSHARE_FRAMEWORK_CAPS=1``, which
    makes the TaskProlog add PyTorch's and JAX's own memory caps merged with the user's settings
    (``gpushare.node.framework_caps``). MPS jobs are not: their pinned-memory limit is already a hard
    cap enforced by the MPS server, and the device size an MPS client sees differs from the GPU's.
    """
    env: dict[str, str] = {"GPUSHARE_CAPS_MODE": caps.mode}
    if caps.mode == "mps" and pipe_dir:
        env.update(job_env(pipe_dir, 0, caps.mem_limit_mib, caps.thread_percentage))
        env["CUDA_VISIBLE_DEVICES"] = "0"  # the daemon exposes exactly its GPU, as device 0
    if caps.mode in ("mps", "fraction"):
        if caps.fraction is not None:
            env["GPUSHARE_MEMORY_FRACTION"] = fraction_text(caps.fraction)
        if caps.mem_limit_mib is not None:
            env["GPUSHARE_MEM_LIMIT_MIB"] = str(int(caps.mem_limit_mib))
    if framework and caps.mode == "fraction" and caps.fraction is not None:
        env["GPUSHARE_FRAMEWORK_CAPS"] = "1"
    return env


def caps_path(run_dir: str, job: str) -> Path:
    """Where the Prolog leaves a job's exports for the TaskProlog, and the Epilog removes them (``job`` already
    validated)."""
    return Path(run_dir) / "jobs" / f"{job}.json"
