"""Fake mode: safetensors weight files read from their JSON header, never mapped or read.

Why: a pretrained checkpoint is the largest thing a fine-tuning script touches on the host (a 7B model in
bf16 is 14 GB), and safetensors memory-maps it. Under ``--max-cpu-memory`` (an address-space limit) the
mapping alone fails (``unable to mmap``), and reading it would cost the login node the model's size in
page cache for values fake mode never uses: GPU tensors have no data there. Everything the estimate needs
— each tensor's name, dtype and shape — is in the file's header (8-byte little-endian length, then JSON:
``{"name": {"dtype": "F32", "shape": [...], "data_offsets": [a, b]}, "__metadata__": {...}}``).

So, for the capture's duration, ``safetensors.safe_open(..., framework="pt")`` and everything built on it
(``safetensors.torch.load_file``, transformers' ``from_pretrained``, diffusers, PEFT adapters, accelerate)
get :class:`HeaderOpen`, which answers ``keys``/``metadata``/``get_slice``/``get_tensor`` from the header
and hands out ``meta`` tensors of the declared shapes and dtypes. A tensor asked for on the GPU is a
GPU tensor as fake mode has them. One asked for on the host is a *host weight*: a meta tensor too (fake
mode gives no host memory to values it will never use), counted as GPU memory from the moment it is loaded
— checkpoints are read to be put on the GPU, and a script that keeps a loaded copy on the host is sized
high, never low. ``.to('cpu')`` of a host weight is the tensor itself, and copying one into a real host
tensor (``load_state_dict`` into a model built on the host) leaves the destination as it is: its values
were never going to be read on the GPU side either (estimator_cli/device_mode.py). A whole tensor of at most
``SMALL_TENSOR_BYTES`` (a BatchNorm's ``num_batches_tracked`` and running statistics, a bias, a scalar) asked
for with ``get_tensor`` is read from the file, its bytes alone: a script may read those values (``.item()``,
a fill value), as checkpoint_files.py reads the small tensors of a ``torch.save`` file.

Other frameworks (``framework="np"``, ``"flax"``) and profile mode use the real library.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import sys
from typing import Any, Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gpushare.estimator_cli.fake_capture import counted_as_gpu

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own bound on the JSON header
SMALL_TENSOR_BYTES = 64 * 2**10  # a whole tensor of at most this size is read from the file (module docstring)

_DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U64": "uint64", "U32": "uint32", "U16": "uint16",
    "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2", "C64": "complex64",
}

# Storages of the meta tensors that stand for host-side weights (see the module docstring), and of their
# views. Keyed by storage, weakly: a weak reference to the tensor itself would stop ``torch.utils.swap_tensors``
# (``module.to()`` of a model whose parameters are these tensors).
_host_storages: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_host_weight(tensor: torch.Tensor) -> None:
    _host_storages[tensor.untyped_storage()] = True


def is_host_weight(value: Any) -> bool:
    return bool(_host_storages) and isinstance(value, torch.Tensor) and value.is_meta \
        and value.untyped_storage() in _host_storages


def _error(message: str) -> Exception:
    try:
        from safetensors import SafetensorError
    except ImportError:  # the header reader does not need the library; its error type is the script's choice
        return ValueError(message)
    return SafetensorError(message)


def torch_dtype(code: str, where: str) -> torch.dtype:
    name = _DTYPES.get(code)
    dtype = getattr(torch, name, None) if name else None
    if not isinstance(dtype, torch.dtype):
        raise _error(f"{where}: dtype {code!r} is not one this PyTorch has")
    return dtype


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """({name: (dtype code, shape)} in file order of offsets, metadata) from the header alone."""
    tensors, metadata, _ = read_layout(path)
    return tensors, metadata


def read_layout(path: str | os.PathLike[str]) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str],
                                                        dict[str, tuple[int, int]]]:
    """:func:`read_header` and each tensor's (first, end) byte in the file."""
    where = os.fspath(path)
    with open(where, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise _error(f"{where}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise _error(f"{where}: header length {length} bytes is over {MAX_HEADER_BYTES} (not a safetensors file?)")
        raw = handle.read(length)
    if len(raw) < length:
        raise _error(f"{where}: file ends inside its {length}-byte header")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise _error(f"{where}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _error(f"{where}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    entries: list[tuple[int, str, str, tuple[int, ...]]] = []
    spans: dict[str, tuple[int, int]] = {}
    for name, info in header.items():
        try:
            code, shape, offsets = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            start, end = int(offsets[0]), int(offsets[1])
        except (TypeError, KeyError, ValueError, IndexError):
            raise _error(f"{where}: header entry {name!r} lacks dtype, shape or data_offsets") from None
        if any(d < 0 for d in shape):
            raise _error(f"{where}: header entry {name!r} has a negative dimension {list(shape)}")
        entries.append((start, name, str(code), shape))
        spans[name] = (8 + length + start, 8 + length + end)
    entries.sort()
    return {name: (code, shape) for _, name, code, shape in entries}, dict(metadata), spans


class HeaderSlice:
    """What ``safe_open.get_slice`` returns: shape and dtype now, a meta tensor when indexed."""

    def __init__(self, opened: "HeaderOpen", name: str) -> None:
        self._opened, self._name = opened, name
        self._code, self._shape = opened._tensors[name]

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def get_dtype(self) -> str:
        return self._code

    def __getitem__(self, index: Any) -> torch.Tensor:
        # the part's shape from a one-element stand-in: no full-size block for a tensor-parallel shard
        shape = torch.empty((), device="meta").expand(self._shape)[index].shape
        return self._opened._make(self._name, tuple(shape))


class HeaderOpen:
    """Stands in for ``safetensors.safe_open`` with ``framework="pt"`` in fake mode (module docstring)."""

    def __init__(self, filename: str | os.PathLike[str], framework: str, device: Any = "cpu", *,
                 backend: str = "mmap") -> None:
        self._path = os.fspath(filename)
        self._tensors, self._metadata, self._spans = read_layout(self._path)
        self._device = device
        self._host = not (isinstance(device, int) and not isinstance(device, bool)) and \
            str(device).split(":")[0] in ("cpu", "meta")

    def __enter__(self) -> "HeaderOpen":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def keys(self) -> list[str]:
        return sorted(self._tensors)

    def offset_keys(self) -> list[str]:
        return list(self._tensors)

    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def _own(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._host:
            mark_host_weight(tensor)
        return tensor

    def _make(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        dtype = torch_dtype(self._tensors[name][0], f"{self._path}: {name}")
        # on "cuda" the device presenter puts it where fake mode's GPU tensors live (meta)
        if not self._host:
            return self._own(torch.empty(shape, dtype=dtype, device=self._device))
        with counted_as_gpu():  # asked for on meta here, but a host weight: counted (the module docstring)
            return self._own(torch.empty(shape, dtype=dtype, device="meta"))

    def _read_small(self, name: str) -> torch.Tensor | None:
        """The tensor's value from its bytes, when it is small (module docstring); None otherwise."""
        first, end = self._spans[name]
        code, shape = self._tensors[name]
        if end - first > SMALL_TENSOR_BYTES or end <= first:
            return None
        dtype = torch_dtype(code, f"{self._path}: {name}")
        try:
            with open(self._path, "rb") as handle:
                handle.seek(first)
                raw = handle.read(end - first)
            value = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
        except (OSError, RuntimeError, ValueError, TypeError):  # a cut-off file, a dtype frombuffer lacks
            return None
        return value if self._host else value.to(self._device)

    def get_tensor(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise _error(f"{self._path}: no tensor named {name!r}")
        small = self._read_small(name)
        return small if small is not None else self._make(name, self._tensors[name][1])

    def get_tensors(self) -> dict[str, torch.Tensor]:
        return {name: self.get_tensor(name) for name in self._tensors}

    def get_slice(self, name: str) -> HeaderSlice:
        if name not in self._tensors:
            raise _error(f"{self._path}: no tensor named {name!r}")
        return HeaderSlice(self, name)


def _header_open_for(original: Any) -> Any:
    def safe_open(filename: Any, framework: str, device: Any = "cpu", **kwargs: Any) -> Any:
        if str(framework) not in ("pt", "torch", "pytorch"):
            return original(filename, framework, device, **kwargs)
        return HeaderOpen(filename, framework, device, **kwargs)
    safe_open.__doc__ = original.__doc__
    return safe_open


@contextlib.contextmanager
def header_only_weights() -> Iterator[None]:
    """Replace ``safe_open`` in safetensors and in every loaded module that imported it by name (a preloaded
    transformers did: ``from safetensors import safe_open``); modules imported later find the replacement
    in safetensors itself. Restored on exit. ``torch.load`` of a ``torch.save`` checkpoint gets the same
    treatment from its pickle (estimator_cli/checkpoint_files.py)."""
    from gpushare.estimator_cli.checkpoint_files import pickle_only_checkpoints

    with pickle_only_checkpoints(), _header_only_safetensors():
        yield


@contextlib.contextmanager
def _header_only_safetensors() -> Iterator[None]:
    try:
        import safetensors
        import safetensors.torch  # noqa: F401 - binds its own safe_open: replaced below
    except ImportError:
        yield
        return
    original = safetensors.safe_open
    replacement = _header_open_for(original)
    saved: list[tuple[Any, str]] = []
    for module in list(sys.modules.values()):
        # the module's own namespace, never an attribute lookup: getattr would wake lazy modules (the lazy
        # torch._dynamo stand-in imports dynamo, 1.6 s; importlib's LazyLoader executes the module)
        try:
            namespace = object.__getattribute__(module, "__dict__")
        except AttributeError:
            continue
        if type(namespace) is dict and namespace.get("safe_open") is original:
            setattr(module, "safe_open", replacement)
            saved.append((module, "safe_open"))
    try:
        yield
    finally:
        for module, name in saved:
            setattr(module, name, original)
