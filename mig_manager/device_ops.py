"""Idempotent MIG instance operations on a backend: read a GPU's layout, destroy or create one instance.

Why idempotent: the executor may be killed between a driver call and the journal line that records it.
Each operation therefore first asserts whether its effect is already there (docs/style.md #4) — a destroy whose
instance is gone, a create whose instance exists — and only then calls the driver. A half-done destroy
(compute instance gone, GPU instance left) or create (GPU instance without its compute instance) is
finished the same way. Everything goes through :class:`gpushare.gres.device.GpuBackend`, with explicit placements.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dataclasses import replace

from gpushare.gres.device import GpuBackend, GpuInstance
from gpushare.gres.gres_conf import NodeGpu, node_gpus
from gpushare.gres.errors import GpuError, NvmlCode

from gpushare.mig_manager.journal import Op
from gpushare.policy.layout import Instance

Layout = dict[int, tuple[Instance, ...]]  # GPU index -> instances


def read_layout(backend: GpuBackend, gpu: int) -> tuple[Instance, ...]:
    """The GPU instances present now, as layout items (busy flags are not set here)."""
    return tuple(sorted((Instance(gi.profile_name, gi.placement.start) for gi in backend.gpu_instances(gpu)),
                        key=lambda i: i.start))


def find_instance(backend: GpuBackend, gpu: int, profile: str, start: int) -> GpuInstance | None:
    for gi in backend.gpu_instances(gpu):
        if gi.profile_name == profile and gi.placement.start == start:
            return gi
    return None


def busy_instance_ids(backend: GpuBackend, gpu: int) -> set[int]:
    """GI ids with a running compute process (NVML lists processes per GPU with their GI)."""
    return {p.gpu_instance_id for p in backend.processes(gpu) if p.gpu_instance_id is not None}


def has_processes(backend: GpuBackend, gpu: int, profile: str, start: int) -> bool:
    gi = find_instance(backend, gpu, profile, start)
    return gi is not None and gi.id in busy_instance_ids(backend, gpu)


def destroy_instance(backend: GpuBackend, op: Op) -> bool:
    """Destroy ``op``'s instance (compute instances first); False when it was already gone.

    Never forces: a process in the instance makes the driver answer IN_USE, which propagates.
    """
    gi = find_instance(backend, op.gpu, op.profile, op.start)
    if gi is None:
        return False
    if gi.id in busy_instance_ids(backend, op.gpu):
        raise GpuError(NvmlCode.IN_USE, f"{op.text()}: a process runs in GPU instance {gi.id}")
    for ci in backend.compute_instances(op.gpu, gi.id):
        backend.destroy_compute_instance(op.gpu, gi.id, ci.id)
    backend.destroy_gpu_instance(op.gpu, gi.id)
    return True


def create_instance(backend: GpuBackend, op: Op) -> bool:
    """Create ``op``'s GPU instance at its explicit placement, then its compute instance.

    False when both already existed. The profile id is looked up by name on this GPU (ids differ between
    models, docs/mig-profiles.md).
    """
    gi = find_instance(backend, op.gpu, op.profile, op.start)
    made = False
    if gi is None:
        ids = {p.name: p.id for p in backend.gi_profiles(op.gpu)}
        if op.profile not in ids:
            raise GpuError(NvmlCode.INVALID_ARGUMENT,
                           f"{op.text()}: GPU {op.gpu} has no profile {op.profile} (has {', '.join(ids)})")
        gi = backend.create_gpu_instance(op.gpu, ids[op.profile], op.start)
        made = True
    if not backend.compute_instances(op.gpu, gi.id):
        backend.create_compute_instance(op.gpu, gi.id)
        made = True
    return made


def diff_ops(current: Mapping[int, Iterable[Instance]], target: Mapping[int, Iterable[Instance]]) -> list[Op]:
    """Destroys of instances not in the target, then creates of the missing ones, largest first.

    Creating largest first matters only for the driver's own placement, which we never use, but it is
    also the order the planner reasons in. GPUs absent from ``target`` are left alone.
    """
    destroys, creates = [], []
    for gpu in sorted(target):
        have = {i.placement for i in current.get(gpu, ())}
        want = {i.placement for i in target[gpu]}
        destroys += [Op("destroy", gpu, p, s) for p, s in sorted(have - want, key=lambda x: x[1])]
        creates += [Op("create", gpu, p, s) for p, s in want - have]
    creates.sort(key=lambda o: (o.gpu, -_size(o.profile), o.start))
    return destroys + creates


def _size(profile: str) -> int:
    """Compute slices from the profile name (``3g.20gb`` → 3); ordering only."""
    head = profile.split("g", 1)[0]
    return int(head) if head.isdigit() else 0


def node_gpus_by_placement(backend: GpuBackend) -> list[NodeGpu]:
    """``gpushare.gres.gres_conf.node_gpus`` with each GPU's MIG devices in memory-slice order.

    Why: Slurm numbers a node's ``gpu`` GRES in gres.conf line order (that number is the job's
    CUDA_VISIBLE_DEVICES), and NVML lists MIG devices by GI id, which follows creation history. Ordering
    by placement makes the numbering predictable (slice order) and keeps untouched instances below a
    change at the same index across a reshape.
    """
    gpus = node_gpus(backend)
    out = []
    for info, gpu in zip(backend.gpus(), gpus):
        if gpu.mig:
            start = {d.gi_cap_minor: i.placement.start for i in backend.gpu_instances(info.index)
                     for d in backend.mig_devices(info.index) if d.gpu_instance_id == i.id}
            gpu = replace(gpu, mig=tuple(sorted(gpu.mig, key=lambda s: start.get(s.gi_cap_minor, 99))))
        out.append(gpu)
    return out
