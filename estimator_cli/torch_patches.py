"""Small, reversible patches of PyTorch's Python layer that make the captured run take the GPU path.

Each one exists because the CPU run would otherwise allocate differently from the GPU run:
- foreach kernels: optimizers and ``clip_grad_norm_`` use the multi-tensor (foreach) path only on
  devices listed by ``torch.utils._foreach_utils._get_foreach_kernels_supported_devices`` (cuda, xpu,
  privateuse1). Its list-wide temporaries (e.g. Adam's ``exp_avg_sq.sqrt()`` for all parameters at once)
  are part of the real step peak, so meta (fake) and cpu (profile) are added for the capture.
- DataLoader: worker processes and pinned host memory never touch GPU memory; running the loader
  in-process (``num_workers=0``) and making ``pin_memory`` the identity saves time and works without CUDA.
- GradScaler: it skips ``optimizer.step()`` when the scaled gradients overflowed, which it learns from
  ``found_inf.item()``. Fake mode has no values; the step is taken, as it is on every step that does not
  overflow (the normal case, and the one with the larger memory peak: the step allocates).
- ``torch.compile``: Dynamo traces with fake tensors of its own, outside the device presenter, so a
  compiled function's ``torch.arange(device="cuda")`` reaches the real (absent) CUDA runtime, and
  tracing costs tens of seconds on a login node. The capture runs the compiled module or function
  eagerly instead (``torch.compile`` returns it unchanged; a module gets ``_orig_mod`` pointing to itself,
  as scripts that unwrap the compiled module expect). Eager memory is an upper bound for compiled
  training: AOTAutograd's min-cut partitioner (``torch/_functorch/partitioners.py``) saves at most what
  eager autograd saves, and Inductor fuses pointwise temporaries away.
- bitsandbytes: imported as the real host sees CUDA (estimator_cli/quantized.py), so it loads and its
  operators' fake kernels serve the GPU side.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.optim.optimizer as optim_mod
import torch.utils._foreach_utils as foreach_utils
import torch.utils.data as data_mod
import torch.utils.data._utils.pin_memory as pin_mod

from gpushare.estimator_cli.quantized import host_imported_bitsandbytes


@contextlib.contextmanager
def gpu_path_patches(extra_device: str, fake: bool) -> Iterator[None]:
    """Apply the patches; ``extra_device`` is where GPU tensors really live (meta or cpu)."""
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    original_devices = foreach_utils._get_foreach_kernels_supported_devices

    def supported_devices() -> list[str]:
        return list(original_devices()) + [extra_device]

    patch(foreach_utils, "_get_foreach_kernels_supported_devices", supported_devices)
    if hasattr(optim_mod, "_get_foreach_kernels_supported_devices"):
        patch(optim_mod, "_get_foreach_kernels_supported_devices", supported_devices)

    original_init = data_mod.DataLoader.__init__

    def loader_init(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) >= 6:  # num_workers given positionally (rare): rebind everything by name
            names = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "num_workers",
                     "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn")
            kwargs.update(dict(zip(names, args)))
            args = ()
        kwargs.update(num_workers=0, persistent_workers=False, prefetch_factor=None)
        original_init(self, *args, **kwargs)

    patch(data_mod.DataLoader, "__init__", loader_init)
    patch(pin_mod, "pin_memory", lambda data, device=None: data)

    def eager_compile(model: Any = None, *args: Any, **kwargs: Any) -> Any:
        if model is None:  # @torch.compile(mode=...) used as a decorator factory
            return lambda fn: fn
        if isinstance(model, torch.nn.Module):
            object.__setattr__(model, "_orig_mod", model)  # not registered: no submodule cycle
        return model

    patch(torch, "compile", eager_compile)
    if hasattr(torch.nn.Module, "compile"):
        patch(torch.nn.Module, "compile", lambda self, *a, **k: None)

    if fake:
        def maybe_opt_step(self: Any, optimizer: Any, optimizer_state: Any, *args: Any, **kwargs: Any) -> Any:
            return optimizer.step(*args, **kwargs)

        patch(torch.amp.GradScaler, "_maybe_opt_step", maybe_opt_step)
    try:
        with host_imported_bitsandbytes():
            yield
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)
