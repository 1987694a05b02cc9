"""The user's ``optimizer.step()``, timed: the rate plans step the training state at (R15).

The hardware's optimizer rates are another optimizer's: a memory roofline on the device and
``swapsched calibrate``'s fused AdamW on the host. The user's own steps at its own pace:
``torch.optim.AdamW`` with its defaults steps CPU tensors one at a time, 10-20x slower than the
fused kernel on this 2-core machine (gpt small's 867K parameters: about 11 ms, against 0.6 ms).
A plan that steps groups on the host, or a prediction of a step that includes the optimizer's,
built on the hardware's figure alone is wrong by that much.

:class:`OptimizerSteps` times every ``step()`` of one optimizer from torch's global step hooks,
filtered to that optimizer: torch runs the global pre-hooks before an optimizer's own and the
global post-hooks after them, so the state mover's work at the step (its own step hooks, fetches
and copies back) is inside. The times are device marks (``Backend.mark``: the host clock on the
emulated device, CUDA events on a GPU), read once the device has run them, so timing adds no
synchronization to the loop. ``PolicyRuntime`` (``swapper.py``) keeps the profiling steps' times
for the trace (``RuntimeState.with_state``) and reports each step's.
"""

from __future__ import annotations

import statistics
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from swapsched.runtime.backends import Backend

__all__ = ["OptimizerSteps"]


class OptimizerSteps:
    """The steps of ``optimizer`` on ``backend``'s clock (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, backend: Backend) -> None:
        self.optimizer, self.backend = optimizer, backend
        #: the elements it steps (its parameters that take a gradient)
        self.params = sum(p.numel() for group in optimizer.param_groups for p in group["params"] if p.requires_grad)
        #: (seconds, whether the state stepped on the host) of the steps taken while profiling
        self.profiled: list[tuple[float, bool]] = []
        self._start: Any = None  # the running step's first mark
        self._last: tuple[Any, Any] | None = None  # the latest step's marks, not yet read
        self._last_s: float | None = None
        # the process-wide hooks hold this object weakly: a runtime dropped without close() leaves
        # them doing nothing, not keeping its optimizer alive
        me = weakref.ref(self)

        def pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if (steps := me()) is not None:
                steps._pre(optimizer)

        def post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if (steps := me()) is not None:
                steps._post(optimizer)

        self._handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def _pre(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is self.optimizer:
            self._start = self.backend.mark()

    def _post(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is self.optimizer and self._start is not None:
            self._last, self._start, self._last_s = (self._start, self.backend.mark()), None, None

    def last_s(self) -> float | None:
        """The latest step's seconds since the last ``settle`` (None: none stepped since); on a
        GPU this waits for the device to reach the step's end."""
        if self._last is not None and self._last_s is None:
            self.backend.synchronize()
            self._last_s = self.backend.elapsed_s(*self._last)
        return self._last_s

    def settle(self, profiling: bool, on_host: bool) -> None:
        """As a training step begins: the step since the last one, kept where it followed a
        profiling step (``profiling``), with where the state stepped (``on_host``: every group
        on the host, as a profiling step below the state's bytes runs, R17)."""
        seconds = self.last_s()
        if seconds is not None and profiling:
            self.profiled.append((seconds, on_host))
        self._last = self._last_s = None

    def rates(self, emulated: bool) -> dict[str, float] | None:
        """R15 (``state.MEASURED_OPTIMIZER_RATES``): parameters a second the profiling steps'
        optimizer steps ran at, where they stepped; on the emulated device both, the device
        being the host. The first step is left out where there are others: it makes the
        optimizer's state (AdamW's moments). None before any step was timed."""
        if not self.profiled or not self.params:
            return None
        later = self.profiled[1:] or self.profiled
        rate = self.params / max(statistics.median(s for s, _ in later), 1e-9)
        if emulated:
            return {"device": rate, "host": rate}
        return {"host" if later[-1][1] else "device": rate}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
