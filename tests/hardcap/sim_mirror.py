"""Shows one process's memory on the fake CUDA driver (tests/hardcap/fake_cuda.c) on the simulated GPUs.

The fake driver starts this once per process, on its first allocation, when ``FAKE_CUDA_SIM_MIRROR`` names
it: ``sim_mirror.py STATE GPU`` plus the two arguments the fake adds, the process's pid and its usage file
(one int64, the bytes it holds, updated by the fake). Standard input is a pipe from that process: end-of-file
means it has ended. Every 0.1 s a changed usage is written into the simulated GPU state the way
tests/agent/simjob.py writes a process (``start_process(host=True)``, ``update_process``, ``end_process``:
the state file's own locking), so the node agent samples the job's real usage on the fake device, as it
would read NVML's per-process used memory over a real driver.
"""

from __future__ import annotations

import os
import select
import struct
import sys

from gpushare.gres.errors import GpuError
from gpushare.gres.sim_backend import SimBackend

MiB = 1 << 20
PERIOD_S = 0.1


def held(path: str) -> int:
    with open(path, "rb") as handle:
        return int(struct.unpack("q", handle.read(8))[0])


def main() -> int:
    state, gpu, pid, usage = sys.argv[1], int(sys.argv[2].split(",")[0]), int(sys.argv[3]), sys.argv[4]
    backend = SimBackend.open(state)
    shown: int | None = None
    try:
        while True:
            readable, _, _ = select.select([0], [], [], PERIOD_S)
            ended = bool(readable) and not os.read(0, 4096)
            now = held(usage)
            if now != shown:
                if shown is None:
                    backend.start_process(gpu, pid, now, host=True)
                else:
                    backend.update_process(pid, memory_mib=now / MiB)
                shown = now
            if ended:
                break
    except GpuError as exc:  # the process ended and the simulated GPU forgot it first
        print(f"sim_mirror: pid {pid}: {exc}", file=sys.stderr)
    finally:
        if shown is not None:
            try:
                backend.end_process(pid)
            except GpuError:
                pass  # already reaped as a dead host process
        try:
            os.unlink(usage)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
