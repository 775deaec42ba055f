"""One rank of a multi-GPU job in one CPU process: ``init_process_group`` gives PyTorch's fake process group.

Why: a torchrun script calls ``init_process_group("nccl")``, which needs a GPU and the other ranks. PyTorch's
fake process group (``torch.testing._internal.distributed.fake_pg``: backend ``fake`` with a ``FakeStore``)
answers every collective at once without data, with the rank and world size it was given, so the script
builds what rank 0 of that world builds: DDP's gradient buckets (allocated by its reducer through the
dispatcher, so the capture records them), FSDP2's (``fully_shard``) per-rank shards of parameters,
gradients and optimizer state, and the buffers of the collectives it issues; DeepSpeed ZeRO's partitions
(estimator_cli/deepspeed_fake.py). The world size comes from
the launcher line (estimator_cli/launch_line.py) through ``GPUSHARE_ESTIMATE_WORLD_SIZE``. A barrier
ignores ``device_ids``, with which PyTorch would allocate its token on a CUDA device the CPU build of profile
mode does not have.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Iterator

from gpushare.estimator_cli.launch_line import WORLD_SIZE_VAR


class _KeptBuckets:
    """DDP's reducer without the rebuild of its buckets in gradient-ready order before the second forward:
    the rebuild broadcasts rank 0's bucket layout and reads it back, which needs values the fake group does
    not have; the rebuilt buckets hold the same gradients under the same size cap, so the memory is the same
    (the old buckets are freed as the new ones are made)."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def _bucket_in_place(state: Any, bucket: Any) -> Any:
    import torch

    future: Any = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


@contextlib.contextmanager
def fake_process_group() -> Iterator[None]:
    """While active (only when the launcher line gave a world size): every ``init_process_group`` call, any
    backend, makes a fake group of rank 0 in that world; the group is destroyed afterwards."""
    size = os.environ.get(WORLD_SIZE_VAR, "")
    if not size.isdigit():
        yield
        return
    world = int(size)
    # DeepSpeed picks its accelerator when first asked; on a CPU-only host it would pick the CPU and keep the
    # model there. The job runs on CUDA GPUs: the presented one (estimator_cli/deepspeed_fake.py)
    accelerator_set = "DS_ACCELERATOR" not in os.environ
    os.environ.setdefault("DS_ACCELERATOR", "cuda")
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    original = distributed_c10d.init_process_group
    undo_deepspeed: list[Callable[[], None]] = []

    def init_process_group(backend: Any = None, init_method: Any = None, timeout: Any = None,
                           world_size: int = -1, rank: int = -1, store: Any = None, group_name: str = "",
                           pg_options: Any = None, device_id: Any = None, **kwargs: Any) -> None:
        # the script's backend (nccl, gloo, "cuda:nccl,cpu:gloo"), address and store are the job's own;
        # the fake group needs none of them
        original(backend="fake", store=FakeStore(), rank=0, world_size=world, timeout=timeout,
                 group_name=group_name)
        if "deepspeed" in sys.modules and not undo_deepspeed:  # deepspeed.init_distributed() comes here
            from gpushare.estimator_cli.deepspeed_fake import patch_deepspeed

            undo_deepspeed.append(patch_deepspeed())

    dist.init_process_group = init_process_group  # type: ignore[assignment]
    distributed_c10d.init_process_group = init_process_group  # type: ignore[assignment]
    barrier = distributed_c10d.barrier

    def fake_barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
        # device_ids makes the barrier allocate a one-element tensor on that CUDA device (accelerate's
        # wait_for_everyone does this): in profile mode the CPU build has no CUDA device for it, and the
        # fake group synchronises nothing
        return barrier(group=group, async_op=async_op)

    dist.barrier = distributed_c10d.barrier = fake_barrier  # type: ignore[assignment]
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp_init, ddp_register = DDP.__init__, DDP.register_comm_hook
    _bucket_in_place.__annotations__ = {}  # DDP checks real annotations; this module's are strings

    def init(ddp: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        if not any(p.is_meta for p in module.parameters()):
            # profile mode: the "GPU" module is on the CPU, where DDP refuses device_ids
            args, kwargs = (), {k: v for k, v in kwargs.items() if k not in ("device_ids", "output_device")}
        ddp_init(ddp, module, *args, **kwargs)
        # the fake group's all-reduce completes with no tensor, which DDP's built-in hook asserts against;
        # an all-reduce works in place on the bucket, so handing the bucket back keeps its memory the same
        ddp_register(ddp, None, _bucket_in_place)
        ddp.reducer = _KeptBuckets(ddp.reducer)

    setattr(DDP, "__init__", init)
    from torch.nn.parallel import distributed as ddp_module

    # DDP's check that every rank has the same parameters broadcasts rank 0's shapes and reads them back on
    # the host; the fake group moves no data, so it compared against whatever that host buffer held (and
    # failed once the CPU allocations around it changed). Every rank here is this one process.
    verify = getattr(ddp_module, "_verify_param_shape_across_processes", None)
    if verify is not None:
        setattr(ddp_module, "_verify_param_shape_across_processes", lambda process_group, tensors, logger=None: None)
    import torch

    accelerator = torch._C._get_accelerator
    # FSDP2's default mesh and device follow the accelerator, which a CPU build reports as the CPU
    setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    setattr(DDP, "register_comm_hook", lambda ddp, state, hook: None)  # the script's own: the one above stands
    try:
        yield
    finally:
        for undo in undo_deepspeed:
            undo()
        if accelerator_set:
            os.environ.pop("DS_ACCELERATOR", None)
        setattr(DDP, "__init__", ddp_init)
        if verify is not None:
            setattr(ddp_module, "_verify_param_shape_across_processes", verify)
        setattr(torch._C, "_get_accelerator", accelerator)
        setattr(DDP, "register_comm_hook", ddp_register)
        dist.init_process_group = original  # type: ignore[assignment]
        distributed_c10d.init_process_group = original  # type: ignore[assignment]
        dist.barrier = distributed_c10d.barrier = barrier  # type: ignore[assignment]
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
