"""The capture format: what the child process hands the parent (a contract, docs/style.md #8).

One capture is a list of events in program order. An allocation carries its size in bytes (the storage's
``nbytes``, before any allocator rounding), the stream (always 0: scripts we capture run on the default
stream), the module path active when it was made (``""`` outside any module), the phase, the iteration
(number of optimizer steps completed before it) and the op that made it. A free names the allocation.
Blocks never freed are alive when capture stopped (parameters, optimizer state, cached batches).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

CAPTURE_VERSION = 1


@dataclass(frozen=True)
class PresentedGpu:
    """What the script is told about "its" GPU (parent → child, as JSON; no torch needed to build it)."""

    name: str  # e.g. "NVIDIA A100-SXM4-80GB"
    total_memory: int  # bytes, as cudaGetDeviceProperties reports (MIG: the instance's memory)
    major: int  # compute capability, e.g. 8 for sm_80
    minor: int
    multi_processor_count: int

    @property
    def bf16(self) -> bool:
        return self.major >= 8  # bf16 tensor cores from Ampere (sm_80) on


class Phase(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    ZERO_GRAD = "zero_grad"
    OTHER = "other"


class Kind(str, Enum):
    """What a block holds; decided by the phase tracker's claims, default by phase."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"  # made in forward or backward and not claimed otherwise
    TEMPORARY = "temporary"  # made in optimizer step or zero_grad and not claimed
    DATA = "data"  # made outside the phases above: batches moved to the GPU, misc
    WORKSPACE = "workspace"  # added by the orchestrator: cuBLAS/cuDNN workspaces


DEFAULT_KIND = {Phase.FORWARD: Kind.ACTIVATION, Phase.BACKWARD: Kind.ACTIVATION, Phase.OPTIMIZER: Kind.TEMPORARY,
                Phase.ZERO_GRAD: Kind.TEMPORARY, Phase.OTHER: Kind.DATA}


@dataclass
class Alloc:
    id: int
    size: int  # bytes requested (storage nbytes)
    module: str
    phase: str  # Phase value
    iteration: int
    op: str  # aten op or "" when unknown (profile mode)
    kind: str = ""  # Kind value; "" until classified
    # Convolution geometry when a convolution op made this block (fake mode only), else None: see
    # :class:`ConvGeometry`. The orchestrator needs it for cuDNN's workspace, which depends on the
    # input and filter shapes, not only on the output's size.
    conv: list[int] | None = None
    # When a ``sum``/``mean`` made this block (fake mode only): the device-independent part of the CUDA
    # reduction's launch configuration (:func:`gpushare.estimator_cli.reduce_buffer.geometry_of`), from
    # which the orchestrator sizes the staging buffer the kernel allocates for the target GPU.
    reduce: list[int] | None = None


@dataclass(frozen=True)
class ConvGeometry:
    """A 2-D convolution as cuDNN sees it, per output block of a convolution op.

    ``role``: 0 forward output (y), 1 grad_input (dx, backward data), 2 grad_weight (dw, backward
    filter), 3 grad_bias (no cuDNN convolution call). Stored in :attr:`Alloc.conv` as a plain list so
    the capture stays JSON.
    """

    role: int
    n: int  # batch
    c: int  # input channels
    h: int  # input height
    w: int  # input width
    k: int  # output channels
    r: int  # filter height
    s: int  # filter width
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    transposed: bool
    itemsize: int  # bytes per element of the input

    def to_list(self) -> list[int]:
        return [self.role, self.n, self.c, self.h, self.w, self.k, self.r, self.s, *self.stride, *self.padding,
                *self.dilation, self.groups, int(self.transposed), self.itemsize]

    @classmethod
    def from_list(cls, row: list[int]) -> "ConvGeometry":
        (role, n, c, h, w, k, r, s, sh, sw, ph, pw, dh, dw, groups, transposed, itemsize) = row
        return cls(role, n, c, h, w, k, r, s, (sh, sw), (ph, pw), (dh, dw), groups, bool(transposed), itemsize)


@dataclass
class Capture:
    """Everything one capture run produced."""

    mode: str  # "fake" or "profile"
    steps: int  # optimizer steps completed
    stopped: bool  # True: stopped after the requested steps; False: the script ended by itself
    events: list[tuple[str, int]] = field(default_factory=list)  # ("alloc", id) / ("free", id), in order
    allocs: dict[int, Alloc] = field(default_factory=dict)
    zero_grads: list[dict[str, Any]] = field(default_factory=list)  # {"event": index, "set_to_none": bool}
    item_placeholders: int = 0  # `.item()` calls answered with a tainted placeholder (fake mode)
    # fake mode's GPU value reads: {"concrete": {what: count}, "placeholder": {what: count}}
    value_reads: dict[str, dict[str, int]] = field(default_factory=dict)
    fast_forwarded_passes: int = 0  # repeated gradient-free passes replayed, not run (repeat_passes.py)
    optimizers_made: int = 0  # torch.optim optimizers the script constructed (phases.py)
    backward_passes: int = 0  # outermost backward calls before the first optimizer was made (phases.py)
    micro_steps: int = 0  # outermost backward calls observed in all (phases.py)
    stopped_on_repeat: bool = False  # stopped at a repeated accumulation micro-step after step 1 (phases.py)
    version: int = CAPTURE_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version, "mode": self.mode, "steps": self.steps, "stopped": self.stopped,
            "events": self.events,  # (op, id) pairs: JSON arrays as they are, no copy
            "allocs": [[a.id, a.size, a.module, a.phase, a.iteration, a.op, a.kind]
                       + ([a.conv, a.reduce] if a.reduce is not None else [a.conv] if a.conv is not None else [])
                       for a in self.allocs.values()],
            "zero_grads": self.zero_grads, "item_placeholders": self.item_placeholders,
            "value_reads": self.value_reads, "fast_forwarded_passes": self.fast_forwarded_passes,
            "optimizers_made": self.optimizers_made, "backward_passes": self.backward_passes,
            "micro_steps": self.micro_steps, "stopped_on_repeat": self.stopped_on_repeat,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Capture":
        if data.get("version") != CAPTURE_VERSION:
            raise ValueError(f"capture format version {data.get('version')!r}, expected {CAPTURE_VERSION}")
        allocs = {row[0]: Alloc(*row) for row in data["allocs"]}
        events = [(op, int(i)) for op, i in data["events"]]
        for op, i in events:  # invariant: every event names a known allocation
            if i not in allocs:
                raise ValueError(f"capture event {op} names unknown allocation {i}")
        return cls(mode=data["mode"], steps=data["steps"], stopped=data["stopped"], events=events,
                   allocs=allocs, zero_grads=data.get("zero_grads", []),
                   item_placeholders=data.get("item_placeholders", 0),
                   value_reads=data.get("value_reads", {}),
                   fast_forwarded_passes=data.get("fast_forwarded_passes", 0),
                   optimizers_made=data.get("optimizers_made", 0), backward_passes=data.get("backward_passes", 0),
                   micro_steps=data.get("micro_steps", 0), stopped_on_repeat=data.get("stopped_on_repeat", False))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
