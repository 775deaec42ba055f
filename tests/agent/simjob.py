"""A stand-in for a GPU training process inside a Slurm job, on the simulated backend.

It becomes a process on the job's GPU (its own pid, so the agent finds the job through
``/proc/<pid>/environ``), holds it for ``--seconds`` and ends it. ``--delay`` is the time to first
kernel: data loading before the first CUDA call; ``--grow-mib-per-s`` makes its memory grow (a leak);
``--oom-first-run`` ends its first run (not a requeued one) as PyTorch's own OOM does: the caching allocator's
message on standard error and exit status 1, the memory it held measured all along.
The backend comes from the gpushare config the hooks use (``[agent] device_backend``), as a real job
would find its GPU through the driver.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from gpushare.config import load_config
from gpushare.gres import open_backend


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mem-mib", type=float, default=1024)
    parser.add_argument("--smact", type=float, default=0.3)
    parser.add_argument("--smocc", type=float, default=0.1)
    parser.add_argument("--drama", type=float, default=0.1)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--grow-mib-per-s", type=float, default=0.0, help="memory growth while running (a leak)")
    parser.add_argument("--oom-first-run", action="store_true", help="end the first run with PyTorch's OOM")
    parser.add_argument("--jump-after", type=float, default=None, help="seconds until it jumps to --jump-mib")
    parser.add_argument("--jump-mib", type=float, default=0.0, help="its memory after the jump (caps ignored)")
    parser.add_argument("--alloc-after", type=float, default=None,
                        help="seconds until it allocates --alloc-mib more; fails as PyTorch does when the GPU is full")
    parser.add_argument("--alloc-mib", type=float, default=0.0)
    args = parser.parse_args()
    backend = open_backend(load_config().agent.device_backend)
    gpu = int(os.environ["SLURM_JOB_GPUS"].split(",")[0])
    time.sleep(args.delay)
    backend.start_process(gpu, os.getpid(), int(args.mem_mib * 2**20), args.smact, args.smocc, args.drama, host=True)
    try:
        started, mib = time.monotonic(), args.mem_mib
        while time.monotonic() - started < args.seconds:
            time.sleep(0.2)
            elapsed = time.monotonic() - started
            if args.grow_mib_per_s:
                mib = args.mem_mib + args.grow_mib_per_s * elapsed
                backend.update_process(os.getpid(), memory_mib=mib)
            if args.jump_after is not None and elapsed >= args.jump_after:
                args.jump_after, mib = None, args.jump_mib
                backend.update_process(os.getpid(), memory_mib=mib)
            if args.alloc_after is not None and elapsed >= args.alloc_after:
                args.alloc_after = None
                if backend.memory(gpu).free < args.alloc_mib * 2**20:
                    free = backend.memory(gpu).free / 2**30
                    raise SystemExit(f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                                     f"{args.alloc_mib / 1024:.2f} GiB. GPU {gpu} has {free:.2f} GiB free.")
                mib += args.alloc_mib
                backend.update_process(os.getpid(), memory_mib=mib)
    finally:
        backend.end_process(os.getpid())
    if args.oom_first_run and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total "
              f"capacity of 40.00 GiB of which 1.20 GiB is free. Of the allocated memory {mib / 1024:.2f} GiB is "
              "allocated by PyTorch, and 0.10 GiB is reserved by PyTorch but unallocated.", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
