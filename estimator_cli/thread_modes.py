"""Make the capture's torch modes hold in the threads the script starts.

Why: PyTorch keeps the torch-function and torch-dispatch mode stacks per thread, and a new Python thread
starts with empty ones. Hugging Face transformers 5 loads a checkpoint's tensors in a thread pool
(``from_pretrained(..., device_map=...)``), so the workers' ``.to("cuda")`` missed the device presenter
(estimator_cli/device_mode.py) and reached the real CUDA runtime ("Found no NVIDIA driver"), and their
allocations would have missed the recorder. So, for the capture's duration, ``threading.Thread.start``
copies the starting thread's mode stacks into the new thread before its ``run`` (concurrent.futures'
workers are such threads, started by ``submit``). The modes are pushed as they are, not re-entered: their
``__enter__`` installs process-wide hooks once, which the capturing thread already did.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

def _stacks() -> tuple[list[Any], list[Any]]:
    functions = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    dispatch = [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]
    return functions, dispatch


def _with_modes(run: Any, functions: list[Any], dispatch: list[Any]) -> Any:
    def run_under_modes() -> None:
        for mode in dispatch:
            torch._C._push_on_torch_dispatch_stack(mode)
        for mode in functions:
            torch._C._push_on_torch_function_stack(mode)
        try:
            run()
        finally:
            for _ in functions:
                torch._C._pop_torch_function_stack()
            for _ in dispatch:
                torch._C._pop_torch_dispatch_stack(None)  # None: a user mode, not an infra mode key
    return run_under_modes


@contextlib.contextmanager
def modes_follow_threads() -> Iterator[None]:
    """While active, every thread started inherits the starting thread's torch mode stacks."""
    original = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        functions, dispatch = _stacks()
        if functions or dispatch:
            # an instance attribute: Thread._bootstrap_inner calls self.run(), subclasses' overrides included
            setattr(thread, "run", _with_modes(thread.run, functions, dispatch))
        original(thread)

    setattr(threading.Thread, "start", start)
    try:
        yield
    finally:
        setattr(threading.Thread, "start", original)
