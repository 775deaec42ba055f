"""Where the script is: phase, iteration and module, and the "stop after N optimizer steps" rule.

Why hooks and patches rather than profiler annotations: they need no cooperation from the script and
they are the same in both capture modes. Global module forward hooks give the module path; the global
optimizer step hooks give the optimizer phase and count steps; ``zero_grad`` and ``backward`` have no
global hooks, so ``Optimizer.zero_grad``, ``Module.zero_grad``, ``Tensor.backward``,
``torch.autograd.backward`` and ``torch.autograd.grad`` are wrapped (and restored on exit).

Iterations are optimizer steps. A script that makes no ``torch.optim`` optimizer at all (a word-level
LSTM that updates ``p.data`` by hand, a loop that applies its own update rule) counts backward passes
instead: the N+1-th backward starts after N complete iterations, update included, so the stop comes
there. With an optimizer, backward passes are never counted (gradient accumulation runs several per step).

Gradient accumulation: a job that runs several backward passes per optimizer step repeats the same
micro-step (forward, backward into the kept gradients) until its next step, and each window after the
first repeats the second. What must be seen is the first step (the optimizer creates its state there)
and, after it, micro-steps until they repeat with the state alive (the second window's peak is the
first one's plus that state). So once a micro-step after the first step (not the first of its window)
allocates and frees exactly what an earlier one after step 1 did (sizes, ops, modules, phases, the frees of
older blocks), ending at the same live memory, and the micro-steps after step 1 have raised the live
memory above their start at least as far as the worst one of the first window did (the data may choose
the code path or the size: a larger batch once per window must be seen again with the state alive), the
capture stops there (``stopped_on_repeat``); a 3-step capture of a 16-micro-step job observes 19
micro-steps or a few more, not 48. (Short of the first window's worst by less than one small-pool segment,
:data:`RISE_SLACK`, counts as as far.) A job whose micro-steps never repeat (a new shape each time) runs to the
requested steps. Fake mode only (the recorder must expose its events). Not seen: the second step's own
allocations, the same temporaries as the first step's, which allocated the state besides.

Stopping: after the N-th step's post-hook a private ``BaseException`` unwinds the script; a script's
``except Exception`` cannot swallow it. A framework that catches ``BaseException`` around training
(Lightning's teardown moves the module back to the CPU and re-raises whatever it met) may turn the stop
into another error or swallow it; ``stop_raised`` records that the capture was complete before that, so
the caller (estimator_cli/capture.py) keeps the capture instead of reporting the teardown's error. Frees
during that unwinding are not recorded (the recorder stops first), so what is alive at the stop is what
would be alive on the GPU at that point.
"""

from __future__ import annotations

import functools
import time
import weakref
from typing import Any, Callable, Protocol

import torch
from torch.nn.modules import module as module_mod
from torch.optim import optimizer as optimizer_mod

from gpushare.estimator_cli.allocator_config import K_SMALL_BUFFER
from gpushare.estimator_cli.events import Kind, Phase

#: How far the micro-steps after step 1 may stay below the first window's worst rise and still count as having
#: reached it: one small-pool segment. A scalar the first window made once (8 bytes in PEFT's DoRA example)
#: must not keep a 16-micro-step job from stopping at its repeat; a larger batch whose activations add less
#: than that moves the estimate by less than that.
RISE_SLACK = K_SMALL_BUFFER


class StopCapture(BaseException):
    """Raised from the optimizer post-hook after the requested number of steps."""


class Recorder(Protocol):
    recording: bool

    def claim(self, tensor: torch.Tensor, kind: Kind, module: str) -> None: ...

    def event_count(self) -> int: ...


class PhaseTracker:
    """Tracks phase/iteration/module; tells the recorder what parameters, grads and states are."""

    def __init__(self, recorder: Recorder, steps: int, on_step: Callable[[int], None] | None = None) -> None:
        self.recorder = recorder
        self.max_steps = steps
        self.on_step = on_step
        self.phase = Phase.OTHER
        self.iteration = 0
        self.stack: list[str] = []
        self.names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> path
        # id(parameter) -> owning module path. Not a weak-keyed dict: a weak reference on a parameter makes
        # torch.utils.swap_tensors refuse it, and Module._apply swaps parameters on every later move
        # (model.cpu() in a framework's teardown, model.to(dtype)): "Couldn't swap Embedding.weight".
        self.owners: dict[int, str] = {}
        self._lazy_modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> owner name
        self.zero_grads: list[dict[str, Any]] = []
        self.transitions: list[tuple[int, str, int, str]] = []  # (time_ns, phase, iteration, module)
        self._backward_depth = 0
        self.optimizers_made = 0  # torch.optim optimizers constructed while capturing
        self.backward_passes = 0
        self.stop_raised = False  # the requested iterations are complete and StopCapture was raised
        self.micro_steps = 0  # outermost backward passes, in all
        self.window_micro_steps = 0  # outermost backward passes since the last optimizer step
        self.stopped_on_repeat = False  # stopped at a repeated micro-step after the first step
        self._segment_start = 0  # recorder event index where the current micro-step began
        self._first_rise = 0  # the most any micro-step of window 1 (2nd on) raised the live memory
        self._after_rise = 0  # the same after step 1
        self._after_step: set = set()  # fingerprints of micro-steps after step 1 (2nd of a window on)
        self._undo: list[Callable[[], None]] = []

    # -- state --------------------------------------------------------------------------------
    @property
    def module(self) -> str:
        return self.stack[-1] if self.stack else ""

    def _set(self, phase: Phase) -> None:
        self.phase = phase
        self._note()

    def _note(self) -> None:
        self.transitions.append((time.time_ns(), self.phase.value, self.iteration, self.module))

    # -- hooks --------------------------------------------------------------------------------
    def _name(self, mod: torch.nn.Module) -> str:
        name = self.names.get(mod)
        if name is None:
            if not self.stack:  # a root: name its whole tree, and claim its parameters and buffers
                root = type(mod).__name__
                for sub_name, sub in mod.named_modules():
                    self.names.setdefault(sub, f"{root}.{sub_name}" if sub_name else root)
                self._claim_module(mod)
            else:
                self.names[mod] = f"{self.stack[-1]}.{type(mod).__name__}"
            name = self.names[mod]
        return name

    def _claim_module(self, root: torch.nn.Module) -> None:
        for sub_name, sub in root.named_modules():
            self._claim_own(sub, self.names.get(sub, sub_name))

    def _claim_own(self, mod: torch.nn.Module, owner: str) -> None:
        """``mod``'s own parameters and buffers; those of a lazy module (``nn.LazyLinear``) that have no shape
        yet are claimed after its first forward, which materializes them."""
        for kind, tensors in ((Kind.PARAMETER, mod.parameters(recurse=False)), (Kind.BUFFER, mod.buffers(recurse=False))):
            for t in tensors:
                if torch.nn.parameter.is_lazy(t):
                    self._lazy_modules[mod] = owner
                    continue
                if kind is Kind.PARAMETER:
                    self.owners[id(t)] = owner
                self.recorder.claim(t, kind, owner)

    def _pre_forward(self, mod: torch.nn.Module, args: Any) -> None:
        name = self._name(mod)
        if self.phase not in (Phase.BACKWARD, Phase.FORWARD):
            self.phase = Phase.FORWARD
        self.stack.append(name)
        self._note()

    def _post_forward(self, mod: torch.nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()
        if self._lazy_modules and mod in self._lazy_modules:
            self._claim_own(mod, self._lazy_modules.pop(mod))
        self._note()

    def _claim_grads(self, opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.recorder.claim(p.grad, Kind.GRADIENT, self.owners.get(id(p), ""))

    def _pre_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._claim_grads(opt)
        self._set(Phase.OPTIMIZER)

    def _post_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for param, state in opt.state.items():
            owner = self.owners.get(id(param), "") if isinstance(param, torch.Tensor) else ""
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.recorder.claim(value, Kind.OPTIMIZER_STATE, owner)
        self._complete_iteration()

    def _complete_iteration(self) -> None:
        self.iteration += 1
        self.window_micro_steps = 0
        self._set(Phase.OTHER)
        if self.on_step is not None:
            self.on_step(self.iteration)
        self._stop_if_done()

    def _stop_if_done(self) -> None:
        if self.iteration >= self.max_steps:
            self.recorder.recording = False
            self.stop_raised = True
            raise StopCapture()

    def _optimizer_init_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        tracker = self

        def __init__(self: Any, *args: Any, **kwargs: Any) -> Any:
            tracker.optimizers_made += 1
            return original(self, *args, **kwargs)
        return __init__

    # -- wrappers -----------------------------------------------------------------------------
    def _wrap(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(owner, name)
        setattr(owner, name, functools.wraps(original)(make(original)))
        self._undo.append(lambda: setattr(owner, name, original))

    def _zero_grad_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        tracker = self

        def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
            set_to_none = kwargs.get("set_to_none", args[0] if args else True)
            if isinstance(self, torch.optim.Optimizer):
                tracker._claim_grads(self)
            tracker.zero_grads.append({"event": tracker.recorder.event_count(), "set_to_none": bool(set_to_none),
                                       "iteration": tracker.iteration, "time_ns": time.time_ns()})
            previous = tracker.phase
            tracker._set(Phase.ZERO_GRAD)
            try:
                return original(self, *args, **kwargs)
            finally:
                tracker._set(Phase.OTHER if previous != Phase.FORWARD else previous)
        return zero_grad

    def _backward_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        tracker = self

        def backward(*args: Any, **kwargs: Any) -> Any:
            if tracker._backward_depth == 0 and not tracker.optimizers_made:
                # no optimizer: backward passes are the iteration boundary (module docstring)
                if tracker.backward_passes >= 1:
                    tracker._complete_iteration()
                tracker.backward_passes += 1
            tracker._backward_depth += 1
            if tracker._backward_depth == 1:
                tracker._set(Phase.BACKWARD)
            try:
                result = original(*args, **kwargs)
            finally:
                tracker._backward_depth -= 1
                if tracker._backward_depth == 0:
                    tracker._set(Phase.OTHER)
            if tracker._backward_depth == 0:
                tracker._micro_step_done()
            return result
        return backward

    def _micro_step_done(self) -> None:
        """After an outermost backward: stop once a micro-step after the first step repeats (module docstring)."""
        self.micro_steps += 1
        self.window_micro_steps += 1
        fingerprint = getattr(self.recorder, "segment_fingerprint", None)
        segment_rise = getattr(self.recorder, "segment_rise", None)
        if fingerprint is None or segment_rise is None or not self.optimizers_made or not self.recorder.recording:
            return
        start, self._segment_start = self._segment_start, self.recorder.event_count()
        if self.window_micro_steps < 2 or self.iteration >= self.max_steps:
            return  # a window's first micro-step creates the gradients; it is never the repeating one
        rise = segment_rise(start)
        if self.iteration == 0:
            self._first_rise = max(self._first_rise, rise)
            return
        segment = fingerprint(start)
        self._after_rise = max(self._after_rise, rise)
        if segment in self._after_step and self._after_rise + RISE_SLACK >= self._first_rise:
            self.stopped_on_repeat = True
            self.recorder.recording = False
            self.stop_raised = True
            raise StopCapture()
        self._after_step.add(segment)

    def install(self) -> None:
        handles = [
            module_mod.register_module_forward_pre_hook(self._pre_forward),
            module_mod.register_module_forward_hook(self._post_forward, always_call=True),
            optimizer_mod.register_optimizer_step_pre_hook(self._pre_step),
            optimizer_mod.register_optimizer_step_post_hook(self._post_step),
        ]
        self._undo.extend(h.remove for h in handles)
        self._wrap(torch.optim.Optimizer, "zero_grad", self._zero_grad_wrapper)
        self._wrap(torch.optim.Optimizer, "__init__", self._optimizer_init_wrapper)
        self._wrap(torch.nn.Module, "zero_grad", self._zero_grad_wrapper)
        self._wrap(torch.Tensor, "backward", self._backward_wrapper)
        self._wrap(torch.autograd, "backward", self._backward_wrapper)
        self._wrap(torch.autograd, "grad", self._backward_wrapper)
        self._note()

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
