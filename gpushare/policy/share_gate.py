"""Whether a job that could share a GPU should: share only while it would otherwise wait.

Why: sharing a GPU costs each job speed (time-slicing two busy jobs on an H100 gave a combined throughput
of 0.93-0.94, MPS 1.13-1.19; docs/benchmarks.md), and it pays only when the alternative is waiting for a
whole GPU. While the job's partitions have idle whole GPUs beyond what pending jobs already ask for, the
job keeps ``gpu:1`` and lands on one of them; once they run out, it is sized to a share as before.

Once shared, how many jobs one GPU takes is bounded too (:func:`share_shards`): Slurm's shard accounting
counts memory only, so without a bound a GPU of 80 GiB takes ten small jobs, and a burst that finds no
idle GPU stacks them on one GPU for their whole run, long after the burst has passed.

Pure: a queue-pressure view and the count of GPUs already promised since that view was taken in, a
verdict out. ``gpushare-submitd`` builds the view off its hot path (slurm_plugins/queue_view.py); the
simulator's ``--policy live`` builds it from its own cluster (simulator/engine.py). Both call
:func:`gate` and :func:`compute_shards`, so the simulated stack and the deployed one decide alike.
"""

from __future__ import annotations

from dataclasses import dataclass

SHARE_WHEN = ("queued", "always")
COMPUTE_CLASSES = ("light", "medium", "heavy")


@dataclass(frozen=True)
class Pressure:
    """The queue as seen in the job's partitions when the view was last taken."""

    idle_gpus: int  # whole GPUs with nothing allocated on them (no gpu, no shard), on usable nodes
    pending_gpus: int  # GPUs asked for by jobs pending there (a pending shared job counts one)


@dataclass(frozen=True)
class Verdict:
    share: bool  # False: keep the whole GPU the job asked for
    why: str  # one line for the job's record


def gate(share_when: str, pressure: Pressure | None, claimed: int = 0, gpus: int = 1) -> Verdict:
    """Share, or keep ``gpus`` whole GPUs because that many are idle beyond the pending demand.

    ``claimed``: GPUs this decider has already promised to jobs kept whole since the view was taken (a
    burst of submissions between two views must not all count the same idle GPU). ``pressure`` None: no
    usable view (stale, failed): fail toward sharing, the behaviour without this gate.
    """
    if share_when == "always":
        return Verdict(True, "shared whatever the queue ([policy] share_when = always)")
    if pressure is None:
        return Verdict(True, "no fresh queue view; shared as with share_when = always")
    spare = pressure.idle_gpus - pressure.pending_gpus - claimed
    if spare >= gpus:
        return Verdict(False, f"{pressure.idle_gpus} idle GPUs beyond {pressure.pending_gpus + claimed} "
                              "pending: a whole GPU starts it now, sharing would only slow it")
    return Verdict(True, f"{pressure.idle_gpus} idle GPUs, {pressure.pending_gpus + claimed} pending: "
                         "it would wait for a whole GPU")


def compute_shards(compute: str | None, gpu_shards: int) -> int:
    """The fewest shards a job of this compute class asks for on a GPU of ``gpu_shards`` shards.

    A heavy job (busy SMs most of the time) asks for more than half the GPU, so two heavy jobs never pair:
    Slurm's shard accounting then admits a heavy job only beside light or medium ones, which is where MPS
    sharing pays. Light and medium jobs, and jobs of unknown class, are sized by memory alone (0 here).
    """
    if compute == "heavy" and gpu_shards > 0:
        return gpu_shards // 2 + 1
    return 0


def share_shards(memory_shards: int, gpu_shards: int, max_jobs: int) -> int:
    """The shards a shared job asks for: what its memory needs, and at least ``1/max_jobs`` of the GPU, so
    that no more than ``max_jobs`` jobs ever share one GPU (``max_jobs`` 0: memory alone).

    Why a bound on the count and not on measured load: at submit time the job's GPU is not chosen yet, and
    how busy the jobs are is not known (the simulator's utilisation models disagree by a factor of two on
    the same trace). What holds whatever their load is time-slicing's bound: next to ``k`` jobs that keep the
    SMs busy a job runs at ``1/(k+1)`` of its speed or better, for its whole run, while the wait sharing
    saved lasts only until a whole GPU comes free. Bounding ``k`` bounds the worst case of that trade.
    """
    if max_jobs > 0 and gpu_shards > 0:
        return min(gpu_shards, max(memory_shards, gpu_shards // max_jobs))
    return memory_shards
