"""Fake mode: ``torch.load`` of a ``torch.save`` checkpoint (``.bin``, ``.pt``, ``.pth``) reads its pickle only.

Why: the same reason as safetensors headers (estimator_cli/weight_files.py). A ``pytorch_model.bin`` or a
training checkpoint is as large as the model, transformers loads it with ``mmap=True`` (a mapping of the
whole file, which an address-space limit such as ``--max-cpu-memory`` refuses), and without ``mmap`` every
byte is read into host memory. Fake mode uses none of those bytes: GPU tensors have no data there.

How: a checkpoint written by ``torch.save`` since PyTorch 1.6 is a zip archive whose ``data.pkl`` holds the
object structure and refers to each storage by key; ``torch.load(map_location="meta")`` builds every
storage on ``meta`` from the pickle's sizes without reading its record (``load_tensor`` in
``torch/serialization.py``: ``is_meta_map_location`` skips ``get_storage_from_record``). So, for the
capture's duration, ``torch.load`` of such an archive loads to ``meta`` (``mmap`` off: the mapping is what
is refused) and the tensors it returns are *host weights* (weight_files.py): meta tensors counted as GPU
memory from loading, whose ``.to('cpu')`` is themselves and whose copy into a real host tensor leaves the
destination as it is. This holds whatever ``map_location`` asked for — the saved location, ``cpu``,
``cuda:N``, a dict or a callable — because a host weight is sized as a GPU tensor from the start: a
checkpoint loaded to the GPU is counted exactly, one kept on the host is counted high, never low. A call
that itself asks for ``meta`` is passed through unchanged.

Small tensors inside a large checkpoint — an optimizer's ``step`` counters, an epoch or RNG state, a
scheduler's scalars, biases — are read for real (each at most ``SMALL_TENSOR_BYTES``, from its record at
the offset PyTorch notes): a resumed run reads them on the host (``Adam.step`` takes ``step.item()``),
and a host weight has no values. They are then ordinary host tensors, counted when moved to the GPU.

Small checkpoints are read as the script asks: one whose storages total at most ``SMALL_CHECKPOINT_BYTES``
costs the login node little to read, and may well be data rather than weights (token ids, labels, a
vocabulary's tensors) whose values the script reads on the host — a host weight has none. The pickle is
read first either way, to learn that total.

Left to the real loader: TorchScript archives (``torch.jit.load``), safetensors paths (``torch.load``
hands them to safetensors, which weight_files.py already answers from the header), and the pre-1.6
non-zip format, whose storages are read in one pass at the end of the file (``_legacy_load``): those are
read as the script asks.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import zipfile
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

from gpushare.estimator_cli.weight_files import mark_host_weight

_ZIP_MAGIC = b"PK\x03\x04"
SMALL_CHECKPOINT_BYTES = 64 * 2**20  # read for real at or below this many bytes of storages (module docstring)
SMALL_TENSOR_BYTES = 64 * 2**10  # a storage of at most this size in a large checkpoint is read (module docstring)
_WALK_DEPTH = 32  # nesting of a pickled model: box, dict, module, _modules, layer list, layer, ... parameter


def _asks_for_meta(map_location: Any) -> bool:
    if isinstance(map_location, str):
        return map_location == "meta"
    return isinstance(map_location, torch.device) and map_location.type == "meta"


def _zip_checkpoint(f: Any) -> bool:
    """A ``torch.save`` zip archive that is not TorchScript, judged from its magic and central directory
    (the end of the file; no record is read). The file position of an open file is left where it was."""
    if isinstance(f, (str, bytes, os.PathLike)):
        if os.fsdecode(f).endswith(".safetensors"):
            return False
        try:
            with open(f, "rb") as handle:
                return _zip_checkpoint(handle)
        except OSError:
            return False  # the real loader names the missing or unreadable file
    if not (hasattr(f, "read") and hasattr(f, "seek") and hasattr(f, "tell")):
        return False
    try:
        start = f.tell()
    except (OSError, io.UnsupportedOperation):
        return False
    try:
        if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
            return False
        f.seek(start)
        with zipfile.ZipFile(f) as archive:
            names = archive.namelist()
        return any(n.endswith("/data.pkl") or n == "data.pkl" for n in names) and \
            not any(n.endswith("/constants.pkl") or n == "constants.pkl" for n in names)
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
    finally:
        f.seek(start)


Slots = dict[int, list[tuple[Any, Any]]]  # id(tensor) -> the (container, key) places that hold it


def _tensors(value: Any, seen: set[int], found: list[torch.Tensor], slots: Slots, depth: int = 0) -> None:
    """Every tensor reachable through dicts, lists, tuples and object attributes (a pickled module's
    ``_parameters`` too), once each in ``found``; the dict and list places holding each go in ``slots``."""
    if depth > _WALK_DEPTH or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, (str, bytes, int, float, bool, type(None), torch.Tensor)):
        return
    if isinstance(value, dict):
        items: Any = [(value, key, child) for key, child in value.items()]
    elif isinstance(value, list):
        items = [(value, index, child) for index, child in enumerate(value)]
    elif isinstance(value, (tuple, set, frozenset)):
        items = [(None, None, child) for child in value]
    else:
        attributes = getattr(value, "__dict__", None)
        items = [(attributes, key, child) for key, child in attributes.items()] if isinstance(attributes, dict) else []
    for container, key, child in items:
        if isinstance(child, torch.Tensor):
            if container is not None:
                slots.setdefault(id(child), []).append((container, key))
            if id(child) not in seen:
                seen.add(id(child))
                found.append(child)
        else:
            _tensors(child, seen, found, slots, depth + 1)


def _read_small(f: Any, owners: list[torch.Tensor], users: dict[int, int], slots: Slots) -> list[torch.Tensor]:
    """Put a host tensor read from its record in every place that held each small single-user meta
    storage's tensor; the tensors still on meta are returned. ``users`` counts the tensors on each
    owner's storage; a tensor held by a tuple stays a host weight (a tuple cannot be changed in place)."""
    if isinstance(f, (str, bytes, os.PathLike)):
        handle, close = open(f, "rb"), True
    elif hasattr(f, "seek") and hasattr(f, "read"):
        handle, close = f, False
    else:
        return owners
    left: list[torch.Tensor] = []
    try:
        for tensor in owners:
            storage = tensor.untyped_storage()
            offset, size = getattr(storage, "_checkpoint_offset", None), storage.nbytes()
            places = slots.get(id(tensor), [])
            if offset is None or size > SMALL_TENSOR_BYTES or users.get(id(storage), 0) != 1 or not places \
                    or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
                left.append(tensor)
                continue
            handle.seek(offset)
            raw = handle.read(size)
            if len(raw) != size:
                left.append(tensor)
                continue
            data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
            host = torch.empty(0, dtype=tensor.dtype).set_(data.untyped_storage(), tensor.storage_offset(),
                                                           tensor.size(), tensor.stride())
            if isinstance(tensor, torch.nn.Parameter):
                host = torch.nn.Parameter(host, requires_grad=tensor.requires_grad)
            elif tensor.requires_grad:
                host.requires_grad_(True)
            for container, key in places:
                container[key] = host
    finally:
        if close:
            handle.close()
    return left


def _share_storages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of one saved storage (tied weights, a transpose saved beside its base) get one meta storage
    again; one tensor per storage is returned.

    Why: ``torch.load`` shares a storage among its users through a cache that skips storages whose data
    pointer is null, which every meta storage's is, so each user gets a storage of its own. Each meta
    storage carries its record's offset in the archive (``_checkpoint_offset``), the same for every user
    of one saved storage: that is the key that joins them."""
    first: dict[Any, torch.Tensor] = {}
    for tensor in tensors:
        if not tensor.is_meta or tensor.layout != torch.strided:
            continue
        storage = tensor.untyped_storage()
        key = getattr(storage, "_checkpoint_offset", None)
        if key is None:
            key = ("storage", id(storage))
        owner = first.setdefault(key, tensor)
        if owner is not tensor and owner.untyped_storage() is not storage:
            with torch.no_grad():
                tensor.set_(owner.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())
    return list(first.values())


def _pickle_only_load_for(original: Any) -> Any:
    def load(f: Any, map_location: Any = None, pickle_module: Any = None, *, weights_only: Any = None,
             mmap: Any = None, **pickle_load_args: Any) -> Any:
        if _asks_for_meta(map_location) or not _zip_checkpoint(f):
            return original(f, map_location, pickle_module, weights_only=weights_only, mmap=mmap,
                            **pickle_load_args)
        start = None if isinstance(f, (str, bytes, os.PathLike)) else f.tell()
        # built outside the dispatch modes, so the recorder sees each storage once, after the sharing
        with _disable_current_modes():
            box = [original(f, "meta", pickle_module, weights_only=weights_only, mmap=False, **pickle_load_args)]
            found: list[torch.Tensor] = []
            slots: Slots = {}
            _tensors(box, set(), found, slots)
            owners = _share_storages(found)
            small = sum(t.untyped_storage().nbytes() for t in owners) <= SMALL_CHECKPOINT_BYTES
            if not small and start in (None, 0):  # record offsets count from the start of the file
                users: dict[int, int] = {}
                for tensor in found:
                    if tensor.is_meta:
                        users[id(tensor.untyped_storage())] = users.get(id(tensor.untyped_storage()), 0) + 1
                owners = _read_small(f, owners, users, slots)
        if small:
            del box, found, owners, slots
            if start is not None:
                f.seek(start)
            return original(f, map_location, pickle_module, weights_only=weights_only, mmap=mmap,
                            **pickle_load_args)
        for tensor in owners:
            torch.ops.aten.alias.default(tensor)  # the recorder counts a storage when an op returns it
            mark_host_weight(tensor)
        return box[0]
    load.__doc__ = original.__doc__
    load.__wrapped__ = original  # type: ignore[attr-defined]
    return load


@contextlib.contextmanager
def pickle_only_checkpoints() -> Iterator[None]:
    """Replace ``torch.load`` (and ``torch.serialization.load``, and the name in every loaded module that
    imported it: ``from torch import load``) for the block; restored on exit."""
    original = torch.serialization.load
    replacement = _pickle_only_load_for(original)
    saved: list[Any] = []
    for module in list(sys.modules.values()):
        try:
            if getattr(module, "load", None) is original:
                setattr(module, "load", replacement)
                saved.append(module)
        except Exception:  # noqa: BLE001 - a lazy module that fails on attribute access: not ours to fix
            continue
    try:
        yield
    finally:
        for module in saved:
            setattr(module, "load", original)
