"""Make ``torch.cuda`` answer as the target GPU would, on a machine without one.

Why: scripts choose their code path from ``torch.cuda.is_available()``, size buffers from
``get_device_properties(0).total_memory``, call ``synchronize()`` and ``max_memory_allocated()``. On the
CPU-only wheel those raise or say "no GPU", and the script would take its CPU path, which is not what
runs on the cluster. Every patch is recorded and undone on exit (docs/style.md #9).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from gpushare.estimator_cli.events import PresentedGpu  # noqa: F401 - re-exported for the capture side
from gpushare.estimator_cli.launch_line import presented_devices


class _Props:
    """Stands in for ``torch._C._CudaDeviceProperties`` (same attribute names)."""

    def __init__(self, gpu: PresentedGpu) -> None:
        self.name = gpu.name
        self.total_memory = gpu.total_memory
        self.major, self.minor = gpu.major, gpu.minor
        self.multi_processor_count = gpu.multi_processor_count
        self.is_integrated = 0
        self.is_multi_gpu_board = 0
        self.L2_cache_size = 40 << 20
        self.uuid = "GPU-00000000-0000-0000-0000-000000000000"

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory >> 20}MB, multi_processor_count={self.multi_processor_count})")


class _Stream:
    """A do-nothing CUDA stream/event: scripts create them for overlap, memory is unaffected."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> "_Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return lambda *a, **k: None


def _noop_factory() -> Callable[..., None]:
    """A fresh do-nothing function per patched name: torch._dynamo's trace rules reject one function
    object registered under two ``torch.cuda`` names ("Duplicate torch object")."""
    def noop(*args: Any, **kwargs: Any) -> None:
        return None
    return noop


def _memory_stats(live: int, peak: int) -> dict[str, int]:
    """The keys scripts read from ``memory_stats()`` (allocated/reserved, current and peak)."""
    return {"allocated_bytes.all.current": live, "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": live, "reserved_bytes.all.peak": peak,
            "active_bytes.all.current": live, "active_bytes.all.peak": peak, "num_alloc_retries": 0,
            "num_ooms": 0}


@contextlib.contextmanager
def presented_cuda(gpu: PresentedGpu, live_bytes: Callable[[], int], peak_bytes: Callable[[], int]) -> Iterator[None]:
    """Patch ``torch.cuda`` (and ``torch.accelerator``) for the duration of the capture."""
    cuda = torch.cuda
    props = _Props(gpu)
    devices = presented_devices()  # the launcher's processes per node (or --devices): all alike
    patches: dict[tuple[Any, str], Any] = {
        (cuda, "is_available"): lambda: True,
        (cuda, "is_initialized"): lambda: True,
        (cuda, "_lazy_init"): _noop_factory(),
        (cuda, "init"): _noop_factory(),
        (cuda, "device_count"): lambda: devices,
        (cuda, "current_device"): lambda: 0,
        (cuda, "set_device"): _noop_factory(),
        (cuda, "get_device_name"): lambda *a, **k: gpu.name,
        (cuda, "get_device_properties"): lambda *a, **k: props,
        (cuda, "get_device_capability"): lambda *a, **k: (gpu.major, gpu.minor),
        (cuda, "get_arch_list"): lambda: [f"sm_{gpu.major}{gpu.minor}"],
        (cuda, "is_bf16_supported"): lambda *a, **k: gpu.bf16,
        (cuda, "synchronize"): _noop_factory(),
        (cuda, "empty_cache"): _noop_factory(),
        (cuda, "ipc_collect"): _noop_factory(),
        (cuda, "manual_seed"): _noop_factory(),
        (cuda, "manual_seed_all"): _noop_factory(),
        (cuda, "seed"): _noop_factory(),
        (cuda, "seed_all"): _noop_factory(),
        (cuda, "reset_peak_memory_stats"): _noop_factory(),
        (cuda, "reset_max_memory_allocated"): _noop_factory(),
        (cuda, "reset_accumulated_memory_stats"): _noop_factory(),
        (cuda, "memory_allocated"): lambda *a, **k: live_bytes(),
        (cuda, "max_memory_allocated"): lambda *a, **k: peak_bytes(),
        (cuda, "memory_reserved"): lambda *a, **k: live_bytes(),
        (cuda, "max_memory_reserved"): lambda *a, **k: peak_bytes(),
        (cuda, "mem_get_info"): lambda *a, **k: (max(0, gpu.total_memory - live_bytes()), gpu.total_memory),
        (cuda, "memory_summary"): lambda *a, **k: "(gpu-estimate: memory summary not available while estimating)",
        (cuda, "Stream"): _Stream,
        (cuda, "Event"): _Stream,
        (cuda, "stream"): _Stream,
        (cuda, "current_stream"): lambda *a, **k: _Stream(),
        (cuda, "default_stream"): lambda *a, **k: _Stream(),
        (cuda, "set_per_process_memory_fraction"): _noop_factory(),
        (cuda, "set_stream"): _noop_factory(),
        (cuda, "device"): _Stream,  # `with torch.cuda.device(i):` selects the one presented GPU
        (cuda, "device_of"): _Stream,
        (cuda, "memory_stats"): lambda *a, **k: _memory_stats(live_bytes(), peak_bytes()),
        (cuda, "get_rng_state"): lambda *a, **k: torch.zeros(16, dtype=torch.uint8),
        (cuda, "get_rng_state_all"): lambda *a, **k: [torch.zeros(16, dtype=torch.uint8)],
        (cuda, "set_rng_state"): _noop_factory(),
        (cuda, "set_rng_state_all"): _noop_factory(),
        (cuda, "initial_seed"): lambda *a, **k: torch.initial_seed(),
        (cuda, "is_current_stream_capturing"): lambda *a, **k: False,
    }
    # the same random-state functions by their defining module's name (``torch.cuda.random.get_rng_state``):
    # those too would reach the real runtime
    random_mod = getattr(cuda, "random", None)
    if random_mod is not None:
        for name in ("get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all", "manual_seed",
                     "manual_seed_all", "seed", "seed_all", "initial_seed"):
            if hasattr(random_mod, name):
                patches[(random_mod, name)] = patches[(cuda, name)]
    accel = getattr(torch, "accelerator", None)
    if accel is not None:
        patches.update({
            (accel, "is_available"): lambda *a, **k: True,
            (accel, "current_accelerator"): lambda *a, **k: torch.device("cuda"),
            (accel, "device_count"): lambda *a, **k: devices,
            (accel, "current_device_index"): lambda *a, **k: 0,
            (accel, "synchronize"): _noop_factory(),
            (accel, "current_stream"): lambda *a, **k: _Stream(),
            # pytorch/examples' ImageNet script selects its device through torch.accelerator
            (accel, "set_device_index"): _noop_factory(),
            (accel, "set_device_idx"): _noop_factory(),
            (accel, "current_device_idx"): lambda *a, **k: 0,
            (accel, "device_index"): _Stream,
            (accel, "set_stream"): _noop_factory(),
            (accel, "get_device_capability"): lambda *a, **k: {"major": gpu.major, "minor": gpu.minor},
            (accel, "empty_cache"): _noop_factory(),
            (accel, "memory_allocated"): lambda *a, **k: live_bytes(),
            (accel, "max_memory_allocated"): lambda *a, **k: peak_bytes(),
            (accel, "memory_reserved"): lambda *a, **k: live_bytes(),
            (accel, "max_memory_reserved"): lambda *a, **k: peak_bytes(),
            (accel, "reset_peak_memory_stats"): _noop_factory(),
            (accel, "reset_accumulated_memory_stats"): _noop_factory(),
            (accel, "memory_stats"): lambda *a, **k: _memory_stats(live_bytes(), peak_bytes()),
            (accel, "get_memory_info"): lambda *a, **k: (max(0, gpu.total_memory - live_bytes()), gpu.total_memory),
        })
    saved: list[tuple[Any, str, Any, bool]] = []
    try:
        for (owner, name), value in patches.items():
            had = name in vars(owner)
            saved.append((owner, name, vars(owner).get(name), had))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, old, had in reversed(saved):
            if had:
                setattr(owner, name, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
