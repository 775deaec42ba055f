"""Present a ``cuda`` device to an unmodified script, backed by ``meta`` (fake mode) or ``cpu`` (profile).

Why this design (docs/estimator.md records the obstacle): FakeTensorMode can create tensors "on" cuda, but on
the CPU-only wheel any autograd graph through them aborts the process (``InputMetadata`` asks the
missing CUDA device guard for the device; measured here, it is a C++ ``terminate``, not an exception),
and ``model.to('cuda')`` fails before that. So the capture runs the script for real on the CPU, and every
request for the GPU — ``.to('cuda')``, ``.cuda()``, ``device='cuda'`` in a factory, ``torch.device('cuda')``
as a context — is redirected, by this TorchFunctionMode, to:

- ``meta`` in fake mode: GPU tensors then have shapes, dtypes, strides and autograd, but no data and no
  compute, so 3 steps of ResNet-50 cost the same at batch 32 and 256; host-side work (model
  construction, data pipeline, samplers) stays real, so values computed on the CPU are the real ones.
  Meta tensors report ``.device`` as ``cuda:0``, ``.is_cuda`` and not ``.is_meta`` to the script, so
  device-dependent Python (optimizer foreach/fused defaults, ``x.device.type == 'cuda'``, checkpointing's
  device inference, code that skips meta tensors) takes the GPU branch; the capture's own modules see
  ``is_meta`` as it is. Reading a GPU value gives a tainted placeholder (estimator_cli/placeholders.py) or
  stops fake capture. The redirect is only ever an argument to torch: a call that hands a device back
  (``Module.to``'s argument parser) gives the GPU the script asked for, so the module's own ``t.to(device)``
  is a move to the GPU, never the script's ``.to('meta')``.
- ``cpu`` in profile mode: real execution; the moved copies are tagged so the profiler trace can tell
  host memory from "GPU" memory.

Fake mode also skips filling module parameters with their random initial values (``uniform_``,
``normal_`` and the like on a tensor that shares storage with a registered ``nn.Parameter``, including
Hugging Face's ``weight.data.normal_``). Those values never reach the GPU side (it has no data), and
drawing them is most of the time a large model takes to construct on a CPU (GPT-2 small: 1.4 s of
random numbers for 124M parameters). What changes: the skipped parameters keep the memory ``torch.empty``
gave them, and the CPU random stream after model construction is not the one a real run would see;
a script whose tensor *shapes* depend on later random draws is estimated on another draw (profile mode
keeps the stream).

Tensors the script puts on ``meta`` itself (``device="meta"``, ``with torch.device("meta")``,
``.to("meta")``: how transformers and accelerate build a model's skeleton before loading its weights) are
meta tensors too, but not GPU ones: each call says where its outputs go (``fake_capture.placing``), the
recorder keeps those out of the GPU's memory, and they report ``meta`` as their device. A skeleton
materialized on the GPU (``to_empty(device="cuda")``, ``.to("cuda")``) is a new GPU allocation.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from gpushare.estimator_cli import cuda_paths
from gpushare.estimator_cli.fake_capture import is_script_meta, placing, set_placement
from gpushare.estimator_cli.concrete_values import ConcreteValues, data_dependent_call, masks_as_indices
from gpushare.estimator_cli import placeholders
from gpushare.estimator_cli.placeholders import bounded, condition, is_tainted, placeholder, refuse, tainted_array, tainted_list
from gpushare.estimator_cli.sparse_gpu import SparseOnGpu
from gpushare.estimator_cli.tensor_parts import dense_parts, storages
from gpushare.estimator_cli.weight_files import is_host_weight, mark_host_weight

_T = torch.Tensor
_PARSE_TO = torch._C._nn._parse_to  # Module.to's argument parser
_DEVICE_GET = _T.device
_IS_CUDA_GET = _T.is_cuda
_IS_META_GET = _T.is_meta
_OWN_CODE = "gpushare.estimator_cli."  # the capture's own modules read a tensor's real device
# Keyed by the torch callables a mode sees (methods, builtins, slot wrappers: no common type but Callable).
_VALUE_READS: dict[Callable[..., Any], str] = {_T.tolist: ".tolist()", _T.numpy: ".numpy()", _T.__bool__: "a condition on a tensor",
                _T.__index__: "a tensor used as an index", _T.__int__: "int(tensor)"}
_HOST_MOVES: dict[Callable[..., Any], str] = {_T.cpu: ".cpu()"}
_READS: dict[Callable[..., Any], str] = {_T.item: ".item()", _T.__float__: "float(tensor)", _T.__format__: "a formatted tensor",
          **_VALUE_READS, **_HOST_MOVES}
_ASKED_BY_USE = frozenset({_T.__int__, _T.__index__, _T.__bool__})  # answered by where the value goes
# erfinv_: the second half of trunc_normal_. The nn.init functions reach a mode as themselves (they call
# handle_torch_function), and what they call inside the handler is not seen again.
_INIT_FILLS = frozenset({_T.uniform_, _T.normal_, _T.random_, _T.bernoulli_, _T.exponential_, _T.log_normal_,
                         _T.cauchy_, _T.geometric_, _T.erfinv_, torch.nn.init.uniform_, torch.nn.init.normal_,
                         torch.nn.init.kaiming_uniform_})


def _is_inplace_name(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def _has_tainted(values: Any) -> bool:
    """A placeholder among the arguments (top level or one tuple/list deep, as sizes are passed)."""
    for v in values:
        if is_tainted(v) or (isinstance(v, (tuple, list)) and any(is_tainted(x) for x in v)):
            return True
    return False


def _tainted_only_as_data(func: Callable[..., Any], args: tuple, kwargs: dict) -> bool:
    """Placeholders are the *data* of a new GPU tensor, not its size: ``gpu.new([v, ...])``,
    ``gpu.new_tensor([v, ...])``, ``gpu.new_full(size, v)`` (timm all-reduces its running loss for a log line
    as ``reduce_tensor(loss.new([loss_avg]), n).item()``). The new tensor has no values, as every fake GPU
    tensor, so a read of it is a placeholder again and a use that could decide memory is caught there."""
    if func is _T.new or func is _T.new_tensor:
        data = kwargs.get("data", args[1] if len(args) == 2 else None)
        rest = [v for k, v in kwargs.items() if k != "data"]
        return isinstance(data, (list, tuple)) and not _has_tainted(rest) and (len(args) == 2 or "data" in kwargs)
    if func is _T.new_full:
        size = kwargs.get("size", args[1] if len(args) > 1 else None)
        others = [v for k, v in kwargs.items() if k not in ("size", "fill_value")]
        return size is not None and not _has_tainted([size]) and not _has_tainted(others)
    if func in _SCALAR_ARITHMETIC:
        # ``running_loss.item() / num_tokens`` (torchtune's recipes log the loss per token so): an operand of
        # elementwise arithmetic is data; the output has the GPU tensor's shape whatever the value
        return not any(isinstance(v, (list, tuple)) and _has_tainted(v) for v in (*args, *kwargs.values()))
    return False


_SCALAR_ARITHMETIC = frozenset({
    _T.__add__, _T.__radd__, _T.__iadd__, _T.__sub__, _T.__rsub__, _T.__isub__, _T.__mul__, _T.__rmul__,
    _T.__imul__, _T.__truediv__, _T.__rtruediv__, _T.__itruediv__, _T.__pow__, _T.__rpow__,
    _T.add, _T.add_, _T.sub, _T.sub_, _T.mul, _T.mul_, _T.div, _T.div_, torch.add, torch.sub, torch.mul, torch.div,
})


# Factories whose fill value is a Python number (a Scalar): given a one-element GPU tensor, PyTorch reads its
# value with .item() inside the call, which a value-free GPU tensor cannot answer. The position of fill_value.
_SCALAR_FILLS: dict[Callable[..., Any], int] = {_T.new_full: 2, torch.full: 1, torch.full_like: 1}


def _asked_by_init() -> bool:
    """The read comes from torch.nn.init's own code (the first frame outside the capture's modules)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_OWN_CODE):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__") == "torch.nn.init"


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, str):
        return value.split(":")[0] == "cuda"
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return False


def _is_meta_device(value: Any) -> bool:
    return (isinstance(value, str) and value == "meta") or (isinstance(value, torch.device) and value.type == "meta")


def _is_cpu_device(value: Any) -> bool:
    return (isinstance(value, str) and value.split(":")[0] == "cpu") or (
        isinstance(value, torch.device) and value.type == "cpu")


def _lazy_tensors(module: Any) -> list[tuple[str, str]]:
    """``module``'s own parameters and buffers that have no shape yet (``nn.LazyLinear``, PyG's ``Linear(-1,
    ...)``), as (table, name); its children's are their own ``_apply``'s, which ``Module._apply`` calls."""
    return [(table, name) for table in ("_parameters", "_buffers")
            for name, t in getattr(module, table).items() if t is not None and torch.nn.parameter.is_lazy(t)]


def _keep_lazy(module: Any, lazy: list[tuple[str, str]]) -> None:
    """After ``module.cuda()``: each lazy tensor moved to the GPU stays lazy, as on a GPU. There the move
    replaces its data in place (same tensor type); a meta tensor's is not the host tensor's type, so
    ``Module._apply`` made a plain 0-element Parameter of it (a new one, or the same one by swapping its
    contents and class), and the first forward's shape inference then found ``in_features`` 0. A new
    uninitialized one on the GPU takes its place: its first forward materializes it there, counted as the
    script's GPU memory."""
    for table, name in lazy:
        new = getattr(module, table).get(name)  # the old one itself when the move swapped the contents in
        if new is None or torch.nn.parameter.is_lazy(new) or not new.is_meta:
            continue
        # Any: torch's stubs leave out the device and dtype that both constructors take
        kind: Any = torch.nn.parameter.UninitializedParameter if table == "_parameters" \
            else torch.nn.parameter.UninitializedBuffer
        getattr(module, table)[name] = kind(requires_grad=new.requires_grad, device="cuda", dtype=new.dtype)


class CudaPresenter(TorchFunctionMode):
    """Redirects GPU requests to ``target`` (``"meta"`` or ``"cpu"``); see the module docstring."""

    def __init__(self, target: str, sm_major: int, on_gpu_tensor: Callable[[torch.Tensor], None] | None = None):
        super().__init__()
        self.fake = target == "meta"
        self.target = torch.device(target)
        self.sm_major = sm_major
        self.autocast = cuda_paths.AutocastEmulator(real_cpu=not self.fake)
        self.tagged: WeakIdKeyDictionary = WeakIdKeyDictionary()  # profile mode: storages that are "GPU"
        self.on_gpu_tensor = on_gpu_tensor
        self.item_calls = 0
        self.parameter_storages: WeakIdKeyDictionary = WeakIdKeyDictionary()  # fake mode: host parameters
        self.skipped_init_fills = 0
        self.sparse = SparseOnGpu()  # fake mode: sparse tensors "on the GPU" (sparse_gpu.py)
        self.values = ConcreteValues()  # fake mode: real values of small tensors (concrete_values.py)
        self._hook: Any = None
        self._module_moves = 0  # inside Module._apply (model.cpu(), model.to(...)): see _read
        self._saved_apply: Any = None
        self._saved_swap: Any = None  # torch.utils.swap_tensors, patched in fake mode (concrete_values.py)
        # backward's Python hooks see the presenter (FSDP2's gathers): only for a launcher's world, which
        # needs it, so single-process estimates keep their established event sequences
        self.backward_under_mode = False

    def __enter__(self) -> "CudaPresenter":
        if self.fake:
            from torch.nn.modules.module import register_module_parameter_registration_hook

            placeholders.on_assumed.append(self._assumed)

            self._hook = register_module_parameter_registration_hook(self._on_parameter)
            self._saved_apply = torch.nn.Module._apply
            presenter, original = self, self._saved_apply
            self._saved_swap = torch.utils.swap_tensors
            values, swap = self.values, self._saved_swap

            def swap_tensors(t1: Any, t2: Any) -> None:
                with values.swapping(t1, t2):  # its weak references would stop the swap
                    swap(t1, t2)
            torch.utils.swap_tensors = swap_tensors

            def _apply(module: Any, *args: Any, **kwargs: Any) -> Any:
                presenter._module_moves += 1
                lazy = _lazy_tensors(module)
                try:
                    return original(module, *args, **kwargs)
                finally:
                    presenter._module_moves -= 1
                    _keep_lazy(module, lazy)
            # setattr: a patch of torch's own method for the mode's duration, not an override to type-check
            setattr(torch.nn.Module, "_apply", _apply)
        return super().__enter__()

    def _assumed(self, what: str) -> None:
        self.values.note(what, concrete=False)

    def __exit__(self, *exc: Any) -> None:
        if self._assumed in placeholders.on_assumed:
            placeholders.on_assumed.remove(self._assumed)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._saved_apply is not None:
            setattr(torch.nn.Module, "_apply", self._saved_apply)
            self._saved_apply = None
        if self._saved_swap is not None:
            torch.utils.swap_tensors = self._saved_swap
            self._saved_swap = None
        super().__exit__(*exc)

    def _on_parameter(self, module: Any, name: str, param: Any) -> None:
        # a lazy module's UninitializedParameter has no storage until its first forward gives it a shape
        if isinstance(param, torch.Tensor) and not torch.nn.parameter.is_lazy(param) and not param.is_meta:
            for storage in storages(param):
                self.parameter_storages[storage] = True

    # -- helpers ------------------------------------------------------------------------------
    def _on_gpu(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self.fake:
            return t.is_meta
        return any(s in self.tagged for s in storages(t))

    def _tag(self, out: Any) -> Any:
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                for part in dense_parts(t):
                    self.tagged[part.untyped_storage()] = True
                    if self.on_gpu_tensor is not None:
                        self.on_gpu_tensor(part)
        return out

    def _rewrite(self, value: Any) -> tuple[Any, bool]:
        if _is_cuda_device(value) or (isinstance(value, int) and not isinstance(value, bool)):
            return self.target, True
        return value, False

    def _restore_devices(self, out: Any, asked: Any) -> Any:
        """The GPU the script asked for, in place of the target device a call hands back (``Module.to``'s
        argument parser returns the device it was given): the rewrite is an argument to torch, never a
        value the script sees, so a later ``t.to(device)`` is a move to the GPU, not the script's own
        ``.to('meta')``."""
        if isinstance(out, torch.device) and out.type == self.target.type:
            if isinstance(asked, int) and not isinstance(asked, bool):
                return torch.device("cuda", asked)
            return torch.device(asked)
        if type(out) is tuple and any(isinstance(v, torch.device) for v in out):
            return tuple(self._restore_devices(v, asked) for v in out)
        return out

    def _move(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``Tensor.to`` / ``Tensor.cuda``: host→GPU becomes host→target."""
        src = args[0]
        if self.fake and src.layout != torch.strided and (func is _T.cuda or any(
                _is_cuda_device(a) for a in (*args[1:], kwargs.get("device")))):
            return self.sparse.place(src)
        to_meta = False
        if func is _T.cuda:
            args, kwargs = (src, self.target), {k: v for k, v in kwargs.items() if k != "device"}
            func, to_gpu = _T.to, True
        else:
            to_gpu = False
            new_args = [src]
            for a in args[1:]:
                if isinstance(a, (str, torch.device)) or (isinstance(a, int) and not isinstance(a, bool)):
                    to_meta |= _is_meta_device(a)
                    a, hit = self._rewrite(a)
                    to_gpu |= hit
                    if not hit and self.fake and src.is_meta and _is_cpu_device(a):
                        if is_host_weight(src):  # a weight file's tensor stays meta (weight_files.py)
                            return self._host_weight_move(func, (src, *args[1:]), kwargs)
                        return self._read(func, ".to('cpu')", (src, *args[1:]), kwargs)
                new_args.append(a)
            args = tuple(new_args)
            if "device" in kwargs:
                kwargs = dict(kwargs)
                to_meta |= _is_meta_device(kwargs["device"])
                kwargs["device"], hit = self._rewrite(kwargs["device"])
                to_gpu |= hit
                if not hit and self.fake and src.is_meta and _is_cpu_device(kwargs["device"]):
                    if is_host_weight(src):
                        return self._host_weight_move(func, args, kwargs)
                    return self._read(func, ".to('cpu')", (src, *args[1:]), kwargs)
        if not self.fake and to_gpu and not self._on_gpu(src):
            kwargs = dict(kwargs, copy=True)  # a GPU copy is a new allocation; on the CPU `.to` would alias
            return self._tag(func(*args, **kwargs))
        if self.fake and (to_gpu or to_meta):
            if to_gpu and is_script_meta(src):
                kwargs = dict(kwargs, copy=True)  # the script's skeleton put on the GPU: a new allocation
            with placing("gpu" if to_gpu else "meta"):
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if self.fake and not torch.nn.parameter.is_lazy(src):  # a lazy module's tensor has no values yet
            if to_gpu and not src.is_meta:
                self.values.attach_copy(out, src)
            else:
                self.values.propagate(func, args, kwargs, out)
        return out

    def _module_load(self, param: Any, other: Any, assign: bool = False) -> Any:
        """``Tensor.module_load``: how ``load_state_dict`` copies a checkpoint's tensor in while parameters are
        swapped (the capture keeps their identity that way, estimator_cli/capture.py). Torch's own body —
        ``other.detach()``, or ``param.copy_(other).detach()`` — with each call through the presenter, as the
        script's calls go: a weight file's tensor copied into a model on the host leaves the model's tensor as
        it is, and a copy into a GPU tensor gives it the checkpoint's value where that is known."""
        if assign:
            return self.__torch_function__(_T.detach, (), (other,))
        copied = self.__torch_function__(_T.copy_, (), (param, other))
        return self.__torch_function__(_T.detach, (), (copied,))

    def _host_weight_move(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``.to('cpu', ...)`` of a weight read from a file's header: the same on meta (a dtype change is
        made there), and still a host weight."""
        args = tuple("meta" if _is_cpu_device(a) else a for a in args)
        if "device" in kwargs:
            kwargs = dict(kwargs, device="meta")
        out = func(*args, **kwargs)
        mark_host_weight(out)
        return out

    def _read(self, func: Callable[..., Any], what: str, args: tuple, kwargs: dict) -> Any:
        """A GPU value read in fake mode: exact from the tensor's shadow, else the placeholder rules."""
        shadow = self.values.get(args[0])
        if shadow is None and self._module_moves and (func is _T.cpu or func is _T.to):
            # a whole module moved back to the host (a framework's teardown, a checkpoint save): its
            # GPU memory is released as on the GPU; the host copy has the shape, not the values
            self.values.note("a module moved to the CPU (values unknown)", concrete=False)
            src = args[0]
            return torch.empty_strided(src.shape, src.stride(), dtype=src.dtype, device="cpu",
                                       requires_grad=src.requires_grad if src.is_leaf else False)
        if shadow is None:
            if func not in _ASKED_BY_USE:  # those are noted with the use that was found (value_use.py)
                self.values.note(what, concrete=False)
            if func is _T.item or func is _T.__float__:
                self.item_calls += 1
                return placeholder(args[0].is_floating_point())
            if func is _T.__format__:
                self.item_calls += 1
                return format(placeholder(args[0].is_floating_point()), *args[1:])
            return self._value_free_read(func, what, args, kwargs)
        self.values.note(what, concrete=True)
        call = self.values.swapped(args, kwargs)
        assert call is not None
        if func is _T.cpu or func is _T.to:
            out = func(*call[0], **call[1])
            return out.clone() if out is shadow else out
        return func(*call[0], **call[1])

    @staticmethod
    def _gpu_into_host(target: Any, index: Any, value: Any) -> bool:
        """A value-free GPU tensor stored into part of a host tensor (a host index, not a GPU one)."""
        return (isinstance(target, torch.Tensor) and not target.is_meta and isinstance(value, torch.Tensor)
                and value.is_meta and not is_script_meta(value)
                and not (isinstance(index, torch.Tensor) and index.is_meta))

    def _scalar_fill(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A one-element GPU tensor as the fill value of ``new_full``/``full``/``full_like`` (ultralytics'
        ``make_anchors``: ``feats[0].new_full((h * w, 1), stride)`` over the model's stride tensor), read as
        PyTorch reads it, with ``.item()``: its value when the tensor has one (a shadow), else a plain number
        of its kind (the new tensor is value-free either way, as every fake GPU tensor)."""
        i = _SCALAR_FILLS[func]
        in_kwargs = "fill_value" in kwargs
        value = kwargs["fill_value"] if in_kwargs else (args[i] if len(args) > i else None)
        if not (isinstance(value, torch.Tensor) and value.is_meta and not is_script_meta(value)
                and value.numel() == 1):
            return args, kwargs
        scalar = self._read(_T.item, _READS[_T.item], (value,), {})
        if is_tainted(scalar):
            kind = bool if value.dtype is torch.bool else float if value.is_floating_point() \
                or value.is_complex() else int
            scalar = kind(placeholders.PLACEHOLDER_VALUE)
        if in_kwargs:
            return args, {**kwargs, "fill_value": scalar}
        return (*args[:i], scalar, *args[i + 1:]), kwargs

    def _value_free_read(self, func: Callable[..., Any], what: str, args: tuple, kwargs: dict) -> Any:
        """A read of a GPU value fake mode does not have, other than ``.item()``. A copy to the host
        (``.cpu()``, ``.to('cpu')``, ``.numpy()``, ``.tolist()``) gives placeholders of the right shape that
        carry the taint into whatever the host computes with them: image files, metrics, logs get written,
        a condition on them refuses. ``int()`` and a tensor used as an index get a small concrete value when
        the script's source shows the value only indexes, bounds a loop or is printed (value_use.py)."""
        src = args[0]
        if func is _T.cpu or func is _T.to or func is _T.numpy:
            host = self.values.placeholder_host(src)
            if func is _T.to:
                host = func(host, *args[1:], **kwargs)
                self.values.taint_host(host, None)
            return tainted_array(host.numpy()) if func is _T.numpy else host
        if func is _T.tolist:
            return tainted_list(tuple(src.shape))
        if func is _T.__int__ or func is _T.__index__:
            return bounded(what)
        if func is _T.__bool__:
            if _asked_by_init():
                # an initialiser's own test of its draws (PyTorch 2.14's trunc_normal_ redraws while
                # `mask.any()`): values only, never memory; no rejected element, as after the last redraw
                self.values.note("a condition inside torch.nn.init (assumed false)", concrete=False)
                return False
            return condition(what)
        refuse(what)

    def _tainted_host_call(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A placeholder stored into, or computed with, a host tensor (``losses[k] = loss.item()``, a
        running-loss tensor): the host tensor carries the taint, reads of it give placeholders, a
        condition on it refuses (concrete_values.py)."""
        if func in _READS and isinstance(args[0], torch.Tensor) and func is not _T.cpu:
            if func not in _ASKED_BY_USE:
                self.values.note(_READS[func] + " of a host tensor holding a placeholder", concrete=False)
            if func in (_T.item, _T.__float__, _T.__format__):
                self.item_calls += 1
                value = placeholder(True)
                return format(value, *args[1:]) if func is _T.__format__ else value
            if func is _T.numpy:
                return tainted_array(args[0].numpy())
            if func is _T.tolist:
                return tainted_list(tuple(args[0].shape))
            if func is _T.__int__ or func is _T.__index__:
                return bounded(_READS[func] + " of a host tensor holding placeholders")
            if func is _T.__bool__:
                return condition(_READS[func] + " of a host tensor holding placeholders")
            refuse(_READS[func] + " of a host tensor holding placeholders")
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in args) and (
                _has_tainted(args) or _has_tainted(kwargs.values())) and not _tainted_only_as_data(func, args, kwargs):
            refuse("a value from .item() passed to a GPU tensor operation")
        out = func(*self.values.untaint_args(args), **self.values.untaint_kwargs(kwargs))
        self.values.taint_host(out, args[0] if func is _T.__setitem__ or _is_inplace_name(func) else None)
        return out

    # -- the mode -------------------------------------------------------------------------------
    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if self.fake and owner is _DEVICE_GET:
            return torch.device("cuda", 0) if (args[0].is_meta and not is_script_meta(args[0])) \
                or args[0] in self.sparse else func(*args, **kwargs)
        if self.fake and owner is _IS_CUDA_GET:
            return True if (args[0].is_meta and not is_script_meta(args[0])) \
                or args[0] in self.sparse else func(*args, **kwargs)
        if self.fake and owner is _IS_META_GET:
            # a GPU tensor is not a meta tensor to the script (Lightning refuses meta parameters, torchtune
            # skips building its RoPE cache on meta); the capture's own code sees where it really lives
            if args[0].is_meta and not is_script_meta(args[0]) \
                    and not sys._getframe(1).f_globals.get("__name__", "").startswith(_OWN_CODE):
                return False
            return func(*args, **kwargs)
        if self.fake and func is _T.module_load:
            return self._module_load(*args, **kwargs)
        if self.fake and self.sparse.involved(args, kwargs):
            return self.sparse.call(func, args, kwargs, self._rewrite)
        if self.fake and (func is _T.to or func is _T.cuda) and args[0] in self.values.tainted_host:
            out = self._move(func, args, kwargs)  # placeholders moved back to the GPU: still no values
            if isinstance(out, torch.Tensor) and not out.is_meta:
                self.values.taint_host(out, None)
            return out
        if func is _T.to or func is _T.cuda:
            return self._move(func, args, kwargs)
        if (func is torch.device or func is _PARSE_TO) and args and isinstance(args[0], int) \
                and not isinstance(args[0], bool):
            # ``torch.device(0)`` (transformers' device_map="auto") and ``module.to(local_rank)``: index 0 of the
            # current accelerator, which the CPU wheel has none of to ask
            args = (torch.device("cuda", args[0]), *args[1:])
            if func is torch.device:
                return args[0]
        if func is _T.backward and self.backward_under_mode:
            return cuda_paths.run_backward(self, args, kwargs)
        if func is _T.pin_memory:
            return args[0]
        if func is _T.is_pinned:
            return False
        if self.fake:
            if func in _INIT_FILLS:
                target = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
                if isinstance(target, torch.Tensor) and not target.is_meta \
                        and target.layout == torch.strided and target.untyped_storage() in self.parameter_storages:
                    self.skipped_init_fills += 1
                    return target
            if func in _SCALAR_FILLS:
                args, kwargs = self._scalar_fill(func, args, kwargs)
            if func is _T.__setitem__ and len(args) == 3 and self._gpu_into_host(args[0], args[1], args[2]):
                # ``losses[k] = loss`` into a host tensor (litgpt's validate()): PyTorch copies the GPU value to
                # the host, so read it as ``.cpu()`` reads it: its value, or placeholders that taint the host tensor
                args = (args[0], args[1], self._read(_T.cpu, _READS[_T.cpu], (args[2],), {}))
            if self.values.host_taint_involved(args, kwargs):
                return self._tainted_host_call(func, args, kwargs)
            if func is _T.copy_ and len(args) > 1 and is_host_weight(args[1]) and not args[0].is_meta:
                return args[0]  # load_state_dict into a host model: values fake mode never reads
            if func is _T.cpu and args and is_host_weight(args[0]):
                return args[0]
            if args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
                if func in _READS:
                    return self._read(func, _READS[func], args, kwargs)
                if func is _T.get_device:
                    return 0
        where: str | None = None
        if "device" in kwargs:
            kwargs = dict(kwargs)
            if _is_meta_device(kwargs["device"]):
                where = "meta"
            asked = kwargs["device"]
            kwargs["device"], hit = self._rewrite(asked)
            if hit and not self.fake:
                return self._restore_devices(self._tag(func(*args, **kwargs)), asked)
            if hit:
                where = "gpu"
                if func is _PARSE_TO:  # no tensor comes out: only the device to give back
                    return self._restore_devices(func(*args, **kwargs), asked)
        # set in place, not by a helper frame around the call: with one, a Trainer script with gradient
        # checkpointing (benchmarks/current_jobs/hf_trainer_clm.py) estimated 0.25 GiB higher (cause not traced)
        saved = set_placement(where) if where is not None and self.fake else None
        try:
            if func in cuda_paths.COMPOSITES:
                return cuda_paths.run_composite(self, func, args, kwargs)
            if self.fake:
                if func in cuda_paths.SDPA_FUNCS:
                    return cuda_paths.route_sdpa(self.sm_major, args, kwargs)
                args, kwargs = self.autocast.rewrite(func, args, kwargs)
                args = masks_as_indices(self.values, func, args)
                try:
                    out = func(*args, **kwargs)
                except Exception as exc:  # noqa: BLE001 - a data-dependent output shape on meta, or the script's error
                    out = data_dependent_call(self.values, func, args, kwargs, exc)
                self.values.propagate(func, args, kwargs, out)
                return out
        finally:
            if where is not None and self.fake:
                set_placement(saved)
        args, kwargs = self.autocast.rewrite(func, args, kwargs)  # CUDA autocast state, CPU tensors
        out = func(*args, **kwargs)
        if any(self._on_gpu(a) for a in args if isinstance(a, torch.Tensor)):
            self._tag(out)
        return out
