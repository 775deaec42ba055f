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
_WALK_DEPTH = 12  # nesting of a training checkpoint: {"optimizer": {"state": {0: {"exp_avg": tensor}}}}


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


def _tensors(value: Any, seen: set[int], found: list[torch.Tensor], depth: int = 0) -> None:
    """Every tensor reachable through containers, modules and object attributes, once each."""
    if depth > _WALK_DEPTH or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        found.append(value)
        return
    if isinstance(value, (str, bytes, int, float, bool, type(None))):
        return
    if isinstance(value, dict):
        children: Any = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = value
    elif isinstance(value, torch.nn.Module):
        children = [*value.parameters(), *value.buffers()]
    else:
        children = list(getattr(value, "__dict__", {}).values())
    for child in children:
        _tensors(child, seen, found, depth + 1)


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
            loaded = original(f, "meta", pickle_module, weights_only=weights_only, mmap=False, **pickle_load_args)
            found: list[torch.Tensor] = []
            _tensors(loaded, set(), found)
            owners = _share_storages(found)
        if sum(t.untyped_storage().nbytes() for t in owners) <= SMALL_CHECKPOINT_BYTES:
            if start is not None:
                f.seek(start)
            return original(f, map_location, pickle_module, weights_only=weights_only, mmap=mmap,
                            **pickle_load_args)
        for tensor in owners:
            torch.ops.aten.alias.default(tensor)  # the recorder counts a storage when an op returns it
            mark_host_weight(tensor)
        return loaded
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
