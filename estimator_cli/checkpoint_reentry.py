"""Activation checkpointing's recomputation runs under the capture's device presenter.

Why: the recomputation of a checkpointed segment runs inside the backward pass, and there no torch
function mode is on the stack (``torch/utils/checkpoint.py`` re-enters only a default-device context for
it, and the reentrant variant re-enters none). Without the presenter the recomputed forward sees no CUDA
autocast emulation and no device redirect, saves a different set of tensors than the original forward,
and checkpointing fails ("A different number of tensors was saved"). So the function handed to either
checkpoint variant is wrapped: when it runs while the presenter is not on the stack — the recomputation —
the presenter is pushed for its duration.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint as checkpoint_mod
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack


def _under(mode: TorchFunctionMode, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if any(m is mode for m in _get_current_function_mode_stack()):
            return fn(*args, **kwargs)
        torch._C._push_on_torch_function_stack(mode)
        try:
            return fn(*args, **kwargs)
        finally:
            torch._C._pop_torch_function_stack()
    return run


# The non-reentrant variant's generator under each name a release calls it by: up to 2.13 checkpoint() calls
# _checkpoint_without_reentrant_generator; from 2.14 it calls ..._impl (the older name stays as a shim that
# calls it). Each one present is wrapped: a function wrapped twice pushes the presenter once (``_under``).
GENERATORS = ("_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl")


def _metadata_as_stored(x: torch.Tensor) -> dict[str, Any]:
    """The non-reentrant checkpoint's check of each recomputed tensor against the forward's (shape, dtype,
    device), read with torch-function handling off: the device as it is stored, whichever side asks. Under a
    launcher line the backward runs with the presenter pushed (``cuda_paths.run_backward``), so the
    recomputation's hooks asked the presenter ("cuda") while the forward's, called inside its handler, saw the
    storage ("meta"), and every checkpointed job launched by torchrun or accelerate launch failed with
    "Recomputed values ... have different metadata"."""
    with torch._C.DisableTorchFunction():
        return {"shape": x.shape, "dtype": x.dtype, "device": x.device}


@contextlib.contextmanager
def recompute_under(mode: TorchFunctionMode) -> Iterator[None]:
    generators = {name: getattr(checkpoint_mod, name) for name in GENERATORS if hasattr(checkpoint_mod, name)}
    checks = getattr(checkpoint_mod, "_allowed_determinism_checks_to_fns", None)
    default_check = getattr(checkpoint_mod, "_DEFAULT_DETERMINISM_MODE", None)
    original_check = checks.get(default_check) if checks is not None else None
    function_cls = checkpoint_mod.CheckpointFunction
    original_apply = function_cls.apply

    def wrapped(generator: Callable[..., Any]) -> Callable[..., Any]:
        def without_reentrant(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return generator(_under(mode, fn), *args, **kwargs)
        return without_reentrant

    def apply(function: Callable[..., Any], *args: Any) -> Any:
        return original_apply(_under(mode, function), *args)

    for name, generator in generators.items():
        setattr(checkpoint_mod, name, wrapped(generator))
    function_cls.apply = apply  # type: ignore[method-assign]
    if original_check is not None:
        checks[default_check] = _metadata_as_stored  # type: ignore[index]
    try:
        yield
    finally:
        for name, generator in generators.items():
            setattr(checkpoint_mod, name, generator)
        function_cls.apply = original_apply  # type: ignore[method-assign]
        if original_check is not None:
            checks[default_check] = original_check  # type: ignore[index]
