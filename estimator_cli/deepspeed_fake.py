"""DeepSpeed under the fake process group: what DeepSpeed needs changed to run one rank on the presented GPU.

Why: a DeepSpeed job (``deepspeed --num_gpus=N train.py`` or ``torchrun``) reaches ``init_process_group``
through ``deepspeed.init_distributed``, which estimator_cli/fake_distributed.py turns into a fake group of
the launcher's world size; ZeRO then partitions optimizer state (stage 1), gradients (2) and parameters (3)
by that size with ordinary tensor operations and collectives, which the capture records as for any script.
DeepSpeed runs as shipped except for the few places below, each applied only when the script has imported
DeepSpeed, and undone after the capture:

- Its accelerator is CUDA (``DS_ACCELERATOR``, set by fake_distributed.py before DeepSpeed picks one): on a
  CPU-only host it would otherwise pick the CPU and keep the model there.
- The engine records parameter names for debug messages in a map of weak references with finalizers
  (``deepspeed.utils.debug``). In fake mode moving a CPU parameter to the presented GPU swaps the tensor
  (a fake tensor is another type), which PyTorch refuses while a weak reference exists; the names are
  cleared before the engine moves the model and taken again after, as the engine would have them.
- The optimizers' check for an infinite or NaN gradient norm (``is_invalid_grad_norm``, which would skip
  the step) answers "finite": fake tensors have no values, and a normal step is the one whose memory counts
  (the same assumption as for GradScaler's overflow check, estimator_cli/cuda_api.py).
- ZeRO-3's ``defragment`` (parameter partitions copied to the host and back into one device buffer) makes
  the device buffer directly: the same device memory, and fake tensors have no data to copy (in profile
  mode the values are not kept either; under the fake group no collective carries values).
- DeepSpeed's FusedAdam (its default for an ``Adam``/``AdamW`` optimizer section) is a CUDA op compiled on
  first use, which needs nvcc and a GPU. Its memory is torch's fused Adam's: two states per parameter and no
  temporaries of parameter size (one multi-tensor kernel), so torch's ``Adam``/``AdamW(fused=True)`` stands
  in, with the section's learning rate, betas, eps and weight decay. CPU Adam (ZeRO-Offload) is left alone.
- NVTX ranges (profiler markers, ``deepspeed.utils.nvtx.enable_nvtx``) are off: a CPU build has no NVTX.
"""

from __future__ import annotations

import sys
from typing import Any, Callable


_TORCH_ADAM_ARGS = frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad"})


def _finite_norm(norm: Any) -> bool:
    """``is_invalid_grad_norm``: a value-free norm is a normal step's, finite (as GradScaler's check is)."""
    return False


def _defragment(tensors: list[Any]) -> Any:
    """ZeRO-3's ``defragment`` without the trip through host memory: its parameter partitions end as views
    of one device buffer of their total size, the old ones freed first (the round trip through a CPU copy
    exists only to avoid fragmentation, and fake tensors have no data to copy)."""
    import torch

    total = sum(t.numel() for t in tensors)
    dtype, device = tensors[0].dtype, tensors[0].device
    shapes = [t.shape for t in tensors]
    for tensor in tensors:
        tensor.data = torch.empty(0, dtype=dtype, device=device)
    buffer = torch.empty(total, dtype=dtype, device=device)
    offset = 0
    for tensor, shape in zip(tensors, shapes):
        tensor.data = buffer.narrow(0, offset, shape.numel()).view(shape)
        offset += shape.numel()
    return buffer


def patch_deepspeed() -> Callable[[], None]:
    """Apply the changes above to an imported DeepSpeed; the returned function undoes them."""
    engine_module = sys.modules.get("deepspeed.runtime.engine")
    if engine_module is None:
        return lambda: None
    from deepspeed.utils import debug

    engine = engine_module.DeepSpeedEngine
    configure = engine._configure_distributed_model

    def configure_distributed_model(self: Any, model: Any) -> None:
        debug.debug_clear_module_and_param_names()
        configure(self, model)
        debug.debug_extract_module_and_param_names(self.module)

    engine._configure_distributed_model = configure_distributed_model
    from deepspeed.utils import nvtx

    ranges = nvtx.enable_nvtx
    nvtx.enable_nvtx = False

    from deepspeed.runtime import utils
    from deepspeed.runtime.zero import utils as zero_utils

    replaced = [(name, getattr(module, name), new) for module, name, new in
                ((utils, "is_invalid_grad_norm", _finite_norm), (zero_utils, "defragment", _defragment))]
    holders = [(m, name, new) for name, old, new in replaced for module_name, m in list(sys.modules.items())
               if module_name.startswith("deepspeed.") and getattr(m, name, None) is old]
    originals = {name: old for name, old, _ in replaced}
    for holder, name, new in holders:
        setattr(holder, name, new)

    optimizer_configuration = engine.get_optimizer_configuration

    def get_optimizer_configuration(self: Any, parameters: dict[str, Any], adam_w_mode: bool,
                                    *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        chosen, extra = optimizer_configuration(self, parameters, adam_w_mode, *args, **kwargs)
        if getattr(chosen, "__name__", "") != "FusedAdam":
            return chosen, extra
        import torch

        for name in [k for k in parameters if k not in _TORCH_ADAM_ARGS]:  # bias_correction, set_grad_none
            parameters.pop(name)
        return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam), {"fused": True}

    engine.get_optimizer_configuration = get_optimizer_configuration

    def undo() -> None:
        engine._configure_distributed_model = configure
        engine.get_optimizer_configuration = optimizer_configuration
        nvtx.enable_nvtx = ranges
        for holder, name, _ in holders:
            setattr(holder, name, originals[name])

    return undo
