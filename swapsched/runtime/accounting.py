"""What one step under the runtime counts: device memory as it is really held, and the audit meter.

The profiling and the executing steps (``profile_step.py``, ``execute_step.py``) share this base:
the step's records, the accounting of saved bytes against the budget (R4), the stall and copy
counters, and the independent audit meter (``transients.py``'s dispatch mode over an executing
step: every storage alive, by finalizers on the storages themselves).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from swapsched.runtime.profiler import born_gradient_bytes, with_gradients
from swapsched.runtime.reports import Divergence, StepReport
from swapsched.runtime.stash import Record
from swapsched.runtime.transients import TransientMeter

if TYPE_CHECKING:
    import torch

    from swapsched.runtime.frame import StepFrame

__all__ = ["StepExecution"]


class StepExecution:
    """Common bookkeeping of one step: identities, accounting, counters, and the audit meter."""

    # slots: the hooks read and write these at every saved-tensor event
    __slots__ = ("frame", "exits", "backend", "records", "static", "used", "peak", "stall_s", "evicted", "prefetched",
                 "on_demand", "copies", "waits", "guard", "diverged", "divergence", "audit", "meter",
                 "finalizers", "planning_s", "static_base", "alive_state", "had")

    def __init__(self, frame: StepFrame):
        self.frame = frame
        self.backend = frame.backend
        # what the step opened on others (the blocks' recompute meter): closed as it ends or aborts
        self.exits = ExitStack()
        self.records: list[Record] = []
        self.static = self.static_base = frame.static_bytes
        self.used = 0
        self.peak = 0
        self.stall_s = 0.0
        self.evicted = self.prefetched = self.on_demand = 0
        self.copies = self.waits = 0
        self.guard = 0
        self.planning_s = 0.0  # laying out a plan inside the step (a predicted shape, at its first tensor)
        self.diverged = False
        self.divergence: Divergence | None = None
        # every finalizer this step puts on a storage: detached when the step ends, so a storage
        # that outlives many steps (the caller's batch) does not collect one per step
        self.finalizers: list[weakref.finalize] = []
        self.audit = frame.audit and self.backend.emulated
        self.meter: TransientMeter | None = None  # the audit meter, where a step opens it (_audit_meter)
        self.alive_state = 0  # the training state's device bytes beyond the resident part, read off its storages
        # R3, gradients from their birth (frame.gradients_born): the parameters that hold a
        # gradient as the step begins; the others' gradients are born in it. None: counted static
        model = frame.model
        self.had: set[int] | None = with_gradients(model) if frame.gradients_born and model is not None else None
        self.backend.reset_peak()

    def _account(self, delta: int) -> None:
        self.used += delta
        if self.static + self.used > self.peak:
            self.peak = self.static + self.used

    def _audit_meter(self) -> None:
        """Open the audit meter (emulated device; entered as a whole step begins, never inside a
        hook): every storage an op makes in the step, and each saved storage made before it, alive
        until it dies, whoever keeps it (never our accounting); what autograd takes as a
        parameter's gradient is static already, or (R3) one it makes in the step counts from its
        birth (transients.py)."""
        meter = self.meter = self.exits.enter_context(TransientMeter(lambda: 0, grads_born=self.had is not None))
        model = self.frame.model
        meter.hook_gradients((p for p in model.parameters() if self._gradient_static(p)) if model is not None else (),
                             self.exits)

    def _gradient_static(self, p: Any) -> bool:
        """Whether the audit meter leaves ``p``'s gradient to the static bytes (or to the state
        mover's count of the bytes it holds); one it meters from its birth has no hook (R3)."""
        return True

    def _watch(self, storage: Any) -> None:
        """Audit: count ``storage`` as alive until it dies (if the meter did not see it made)."""
        if self.meter is not None:
            self.meter.watch(storage)

    def measured_peak(self) -> int | None:
        if not self.frame.audit:
            return None
        if self.meter is None:
            return self.backend.peak_bytes()
        # R3: the gradients born in the step are in the meter's peak from their birth, not static
        born = born_gradient_bytes(self.frame.model, self.had) if self.had is not None and self.frame.model is not None else 0
        return self.static_base - born + self.meter.peak()

    def state_bytes(self, delta: int) -> None:
        """The state mover's device bytes changed by ``delta`` (R14): they count with the static
        bytes (the room for saved tensors shrinks by them); the audit meter reads its storages."""
        self.static += delta
        if self.static + self.used > self.peak:
            self.peak = self.static + self.used
        state = self.frame.state
        if self.meter is not None and state is not None:
            now = state.measured_device_bytes()  # resized storages: no op makes them, the meter is told
            self.meter.shift(now - self.alive_state)
            self.alive_state = now

    def pack(self, t: torch.Tensor) -> Any:
        """The saved-tensor pack hook: what autograd keeps for ``t``."""
        raise NotImplementedError

    def unpack(self, p: Any) -> torch.Tensor:
        """The unpack hook: ``t`` back from what :meth:`pack` returned."""
        raise NotImplementedError

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        self.records.clear()
        self._drop_finalizers()

    def _on_death(self, storage: Any, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` when ``storage`` dies during this step."""
        self.finalizers.append(weakref.finalize(storage, fn, *args))

    def _drop_finalizers(self) -> None:
        for f in self.finalizers:
            f.detach()
        self.finalizers.clear()

    def report(self, step_s: float) -> StepReport:
        raise NotImplementedError

