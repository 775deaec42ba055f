"""Profile mode: real CPU execution under ``torch.profiler(profile_memory=True)``, as xMem does (§3.2).

The profiler's Chrome trace lists every CPU allocator call as a ``[memory]`` instant event with address,
size (negative for frees) and time. Three things turn that into GPU events:

- pairing: a free closes the most recent allocation at its address;
- which blocks are "GPU": those made inside forward, backward, optimizer step or zero_grad (the script
  computes on its GPU tensors there), plus those the device presenter tagged when the script moved data
  to the GPU or created a tensor there, plus parameters, buffers, gradients and optimizer state claimed by
  the phase tracker. Host-side blocks (the dataset, the model before ``.to('cuda')``) are dropped;
- attribution: phase, iteration and module come from the tracker's time-stamped transitions.

Timestamps: trace ``ts`` is in microseconds since ``baseTimeNanoseconds``; both are wall-clock
(``time.time_ns()``), the clock the tracker uses.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


from gpushare.estimator_cli.events import DEFAULT_KIND, Alloc, Capture, Kind, Phase
from gpushare.estimator_cli.phases import PhaseTracker
from gpushare.estimator_cli.tensor_parts import storages

_GPU_PHASES = {Phase.FORWARD.value, Phase.BACKWARD.value, Phase.OPTIMIZER.value, Phase.ZERO_GRAD.value}


@dataclass
class ProfileRecorder:
    """Collects time-stamped tags and claims by address; resolved against the trace afterwards.

    The profiler records allocator events of the thread that started it only. "GPU" blocks that other
    threads make (transformers 5 moves a checkpoint to the GPU from a thread pool) are therefore kept here,
    with their size, and their free time from a finalizer on the storage: ``off_thread``."""

    recording: bool = True
    stop_ns: int = 0
    marks: list[tuple[int, int, str, str]] = field(default_factory=list)  # (time_ns, addr, kind, module)
    off_thread: list[list[int]] = field(default_factory=list)  # [time_ns, addr, bytes, free time_ns or 0]
    thread: int = field(default_factory=threading.get_ident)
    windows: list[tuple[int, int, str]] = field(default_factory=list)  # (start ns, end ns, kind): see kept_from

    def event_count(self) -> int:
        return -1  # profile mode locates zero_grad by time, not index

    def tag(self, tensor: torch.Tensor) -> None:
        if self.recording:
            other = threading.get_ident() != self.thread
            for storage in storages(tensor):
                now = time.time_ns()
                self.marks.append((now, storage.data_ptr(), "", ""))
                if other and storage.nbytes():
                    block = [now, storage.data_ptr(), storage.nbytes(), 0]
                    self.off_thread.append(block)
                    weakref.finalize(storage, _set_free_time, block)

    def claim(self, tensor: torch.Tensor, kind: Kind, module: str) -> None:
        if self.recording and isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            for storage in storages(tensor):
                self.marks.append((time.time_ns(), storage.data_ptr(), kind.value, module))

    @contextlib.contextmanager
    def kept_from(self, kind: Kind) -> Iterator[None]:
        """Blocks allocated inside this window that outlive it are GPU blocks of ``kind``: for framework
        constructors whose persistent allocations are made in C++, where the presenter cannot tag them
        (DDP's gradient buckets, allocated by its Reducer on the parameters' device)."""
        start = time.time_ns()
        try:
            yield
        finally:
            if self.recording:
                self.windows.append((start, time.time_ns(), kind.value))

    def stop(self) -> None:
        if not self.stop_ns:
            self.stop_ns = time.time_ns()
        self.recording = False


def _set_free_time(block: list[int]) -> None:
    block[3] = time.time_ns()


@dataclass
class _Block:
    addr: int
    size: int
    start: int
    end: int | None = None
    gpu: bool = False
    kind: str = ""
    module: str = ""


def _memory_events(trace_path: str) -> list[tuple[int, int, int]]:
    """(time_ns, addr, bytes) of CPU allocator events, in trace order."""
    with open(trace_path, encoding="utf-8") as handle:
        trace = json.load(handle)
    base = int(trace.get("baseTimeNanoseconds", 0))
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("name") != "[memory]":
            continue
        args = ev.get("args", {})
        if args.get("Device Type", 0) != 0:
            continue
        out.append((base + int(round(float(ev["ts"]) * 1000)), int(args["Addr"]), int(args["Bytes"])))
    out.sort(key=lambda e: e[0])
    return out


def _add_off_thread(recorder: ProfileRecorder, stop_ns: int, blocks: list[_Block], by_addr: dict[int, list[_Block]],
                    order: list[tuple[str, _Block, int]]) -> None:
    """Blocks of other threads (see ProfileRecorder), where the trace has no block of this thread at that
    address and time, merged into ``order`` by time."""
    added = False
    for ts, addr, size, freed in recorder.off_thread:
        if ts > stop_ns or any(b.start <= ts and (b.end is None or ts <= b.end) for b in by_addr.get(addr, [])):
            continue
        end = freed if freed and freed <= stop_ns else None
        block = _Block(addr, size, ts, end, gpu=True)
        blocks.append(block)
        by_addr.setdefault(addr, []).append(block)
        order.append(("alloc", block, ts))
        if end is not None:
            order.append(("free", block, end))
        added = True
    if added:
        order.sort(key=lambda item: item[2])  # stable: the trace's own order within one timestamp


def build_capture(trace_path: str, recorder: ProfileRecorder, tracker: PhaseTracker, stopped: bool) -> Capture:
    stop_ns = recorder.stop_ns or time.time_ns()
    blocks: list[_Block] = []
    open_at: dict[int, _Block] = {}
    by_addr: dict[int, list[_Block]] = {}
    order: list[tuple[str, _Block, int]] = []
    for ts, addr, nbytes in _memory_events(trace_path):
        if ts > stop_ns:
            break
        if nbytes > 0:
            block = _Block(addr, nbytes, ts)
            blocks.append(block)
            open_at[addr] = block
            by_addr.setdefault(addr, []).append(block)
            order.append(("alloc", block, ts))
        elif addr in open_at:
            block = open_at.pop(addr)
            block.end = ts
            order.append(("free", block, ts))
    _add_off_thread(recorder, stop_ns, blocks, by_addr, order)
    for ts, addr, kind, module in recorder.marks:
        for block in reversed(by_addr.get(addr, [])):
            if block.start <= ts and (block.end is None or ts <= block.end):
                block.gpu = True
                if kind and (not block.kind or kind != Kind.PARAMETER.value or block.kind == Kind.DATA.value):
                    block.kind = kind
                if module:
                    block.module = module
                break
    for start, end, kind in recorder.windows:
        for block in blocks:
            if start <= block.start <= end and (block.end is None or block.end > end):
                block.gpu = True
                block.kind = block.kind or kind
    times = [t[0] for t in tracker.transitions]

    def context(ts: int) -> tuple[str, int, str]:
        i = bisect.bisect_right(times, ts) - 1
        if i < 0:
            return Phase.OTHER.value, 0, ""
        _, phase, iteration, module = tracker.transitions[i]
        return phase, iteration, module

    capture = Capture(mode="profile", steps=tracker.iteration, stopped=stopped)
    ids: dict[int, int] = {}
    for op, block, ts in order:
        if op == "alloc":
            phase, iteration, module = context(ts)
            if not (block.gpu or phase in _GPU_PHASES):
                continue
            alloc_id = len(ids)
            ids[id(block)] = alloc_id
            kind = block.kind or DEFAULT_KIND[Phase(phase)].value
            capture.allocs[alloc_id] = Alloc(alloc_id, block.size, block.module or module, phase, iteration, "", kind)
            capture.events.append(("alloc", alloc_id))
        elif id(block) in ids:
            capture.events.append(("free", ids[id(block)]))
    zero_times = [z["time_ns"] for z in tracker.zero_grads]
    event_times = [ts for op, block, ts in order if id(block) in ids]
    for z, t in zip(tracker.zero_grads, zero_times):
        capture.zero_grads.append(dict(z, event=bisect.bisect_left(event_times, t)))
    return capture


@contextlib.contextmanager
def ddp_buckets_kept(recorder: ProfileRecorder) -> Iterator[None]:
    """``DistributedDataParallel(...)`` runs inside ``recorder.kept_from(GRADIENT)``: its Reducer's gradient
    buckets (a copy of the gradients unless ``gradient_as_bucket_view``) are GPU memory on a GPU."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a PyTorch built without distributed
        yield
        return
    original = DistributedDataParallel.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        with recorder.kept_from(Kind.GRADIENT):
            original(self, *args, **kwargs)

    setattr(DistributedDataParallel, "__init__", init)
    try:
        yield
    finally:
        setattr(DistributedDataParallel, "__init__", original)
