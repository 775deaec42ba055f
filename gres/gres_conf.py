"""gres.conf lines and the node line's ``Gres=`` string for a GPU node.

Why generated: the shard counts must equal each GPU's memory in GiB (docs/architecture.md: a shared job asks for
``shard:<GiB>``, so Slurm's own accounting keeps estimates within memory), MIG devices need the right
nvidia-cap minors, and after every MIG repartition the lines must be rewritten exactly — by hand that is
how nodes go INVAL. What Slurm 22.05 accepts (docs/compatibility.md, "Simulated GPUs"):
- whole GPUs: ``Name=gpu Type=<model> File=<dev>/nvidia[0-1]`` (File= must name character devices);
- shards: one line per GPU, ``Name=shard Count=<GiB> File=<dev>/nvidia<minor>``;
- MIG devices: ``Name=gpu Type=<profile> MultipleFiles=<dev>/nvidia<minor>,<dev>/nvidia-caps/nvidia-cap<gi>,…``
  one line per device (the GI access cap, plus the CI access cap as Slurm's own AutoDetect lists it);
- node line: ``Gres=gpu:<model>:<n>,gpu:<profile>:<n>,shard:<total>``.
A GPU in MIG mode offers its MIG devices only (no whole-GPU or shard line). Everything here is pure except
:func:`node_gpus`, which reads a backend.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from gpushare.gpus import BUILTIN_GPUS, GiB, GpuModel
from gpushare.gres.device import GpuBackend

_TYPE_OK = re.compile(r"^[A-Za-z0-9_.+-]+$")


@dataclass(frozen=True)
class MigSlot:
    """One MIG device as gres.conf needs it."""

    profile: str  # GRES type, e.g. "1g.10gb"
    gi_cap_minor: int
    ci_cap_minor: int | None = None


@dataclass(frozen=True)
class NodeGpu:
    """One physical GPU of a node, reduced to what gres.conf needs."""

    minor: int  # /dev/nvidia<minor>
    type: str  # GRES type for the whole GPU, e.g. "a100-40gb"
    shards: int  # shard count (GiB of memory)
    mig: tuple[MigSlot, ...] | None = field(default=None)  # None: not in MIG mode


def _check_type(name: str) -> str:
    if not _TYPE_OK.match(name):
        raise ValueError(f"GRES type {name!r} may contain only letters, digits and _ . + - (Slurm splits on : and ,)")
    return name


def _ranges(numbers: list[int]) -> str:
    """[0,1,2,5] -> "0-2,5" (Slurm hostlist style)."""
    parts, nums = [], sorted(set(numbers))
    start = prev = nums[0]
    for n in nums[1:] + [None]:  # type: ignore[list-item]
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        if n is not None:
            start = prev = n
    return ",".join(parts)


def device_files(minors: list[int], dev_dir: str = "/dev") -> str:
    """``/dev/nvidia0`` for one GPU, ``/dev/nvidia[0-1,3]`` for several."""
    if len(minors) == 1:
        return f"{dev_dir}/nvidia{minors[0]}"
    return f"{dev_dir}/nvidia[{_ranges(minors)}]"


def gres_conf_lines(gpus: list[NodeGpu], dev_dir: str = "/dev", shards: bool = True, ci_caps: bool = True,
                    node_name: str | None = None) -> list[str]:
    """The gres.conf lines for one node (prefixed with ``NodeName=…`` when ``node_name`` is given)."""
    prefix = f"NodeName={node_name} " if node_name else ""
    whole = [g for g in gpus if g.mig is None]
    lines = []
    by_type: dict[str, list[int]] = {}
    for g in whole:
        by_type.setdefault(_check_type(g.type), []).append(g.minor)
    for gtype, minors in by_type.items():
        lines.append(f"{prefix}Name=gpu Type={gtype} File={device_files(minors, dev_dir)}")
    if shards:
        for g in whole:
            if g.shards > 0:
                lines.append(f"{prefix}Name=shard Count={g.shards} File={dev_dir}/nvidia{g.minor}")
    for g in gpus:
        for slot in g.mig or ():
            files = [f"{dev_dir}/nvidia{g.minor}", f"{dev_dir}/nvidia-caps/nvidia-cap{slot.gi_cap_minor}"]
            if ci_caps and slot.ci_cap_minor is not None:
                files.append(f"{dev_dir}/nvidia-caps/nvidia-cap{slot.ci_cap_minor}")
            lines.append(f"{prefix}Name=gpu Type={_check_type(slot.profile)} MultipleFiles={','.join(files)}")
    return lines


def node_gres(gpus: list[NodeGpu], shards: bool = True) -> str:
    """The ``Gres=`` value for the NodeName line, e.g. ``gpu:a100-40gb:2,gpu:1g.5gb:2,shard:80``."""
    counts: Counter[str] = Counter()
    for g in gpus:
        if g.mig is None:
            counts[_check_type(g.type)] += 1
        else:
            for slot in g.mig:
                counts[_check_type(slot.profile)] += 1
    parts = [f"gpu:{t}:{n}" for t, n in counts.items()]
    total_shards = sum(g.shards for g in gpus if g.mig is None) if shards else 0
    if total_shards:
        parts.append(f"shard:{total_shards}")
    return ",".join(parts)


def gres_types(gpus: list[NodeGpu], shards: bool = True) -> str:
    """The ``GresTypes=`` value slurm.conf needs for these lines."""
    return "gpu,shard" if shards and any(g.mig is None and g.shards for g in gpus) else "gpu"


def node_gpus(backend: GpuBackend, catalogue: dict[str, GpuModel] | None = None) -> list[NodeGpu]:
    """Read a node's GPUs from a backend (the one impure function here).

    Type and shard count come from the catalogue model the GPU matched (``GpuModel.shards``); an unknown
    model is typed by its NVML name (lower case, spaces to ``-``) with shards = whole GiB of its memory.
    """
    table = BUILTIN_GPUS if catalogue is None else catalogue
    out = []
    for info in backend.gpus():
        model = table.get(info.model) if info.model else None
        gtype = model.name if model else re.sub(r"[^a-z0-9_.+-]+", "-", info.name.lower()).strip("-")
        nshards = model.shards if model else int(info.total_bytes // GiB)
        mig = None
        if info.mig_current is True:
            mig = tuple(MigSlot(d.profile_name, d.gi_cap_minor, d.ci_cap_minor)
                        for d in backend.mig_devices(info.index))
        out.append(NodeGpu(info.minor, gtype, nshards, mig))
    return out
