"""The run's budget in bytes, per shape (DESIGN.md, "Budgets").

A relative budget (``"60%"``) is resolved once per shape, against that shape's own activation
peak: a padded batch's longer steps get more bytes, its shorter ones fewer. A byte budget is the
same bytes for every shape, and a shape no plan can fit in them is refused with one error that
says why. ``budget="device"`` is resolved at the first step, from the device's capacity.
"""

from __future__ import annotations

from swapsched.budget import BudgetError, check_budget, format_bytes, parse_budget, smallest_feasible
from swapsched.runtime.shapes import first_bytes
from swapsched.trace import Trace

__all__ = ["ShapeBudgets", "DEVICE_MARGIN"]

#: budget="device": the share of the device's capacity left out, for the caching allocator's
#: fragmentation and the CUDA context (PyTorch's own guidance keeps a few percent in reserve)
DEVICE_MARGIN = 0.05


class ShapeBudgets:
    """The budget as given (``spec``), and the bytes it stands for on the current shape (``bytes``).

    ``spec``: ``"60%"``, bytes (``"6GiB"``, an int), or ``"device"`` (resolved by
    :meth:`resolve_device` before the first step)."""

    def __init__(self, spec: str | int | float) -> None:
        self.device = spec == "device"
        self.spec: str | int | float = spec if self.device else check_budget(spec)  # malformed: fails here
        self.bytes: int | None = None  # the current shape's, once a trace has been taken
        self._by_shape: dict[int, int] = {}  # a relative budget per shape (its first saved tensor's bytes)
        self._high = 0  # the most bytes any shape's budget has stood for in this run

    @property
    def relative(self) -> bool:
        """A share of each shape's activation peak (``"60%"``), not bytes."""
        return isinstance(self.spec, str) and self.spec.strip().endswith("%")

    def of(self, trace: Trace) -> int:
        """The budget in bytes of ``trace``'s shape, or the refusal (:class:`BudgetError`) of a
        shape no plan can fit."""
        return self._resolve(self.spec, trace, resolved=self.bytes)

    def or_zero(self, trace: Trace) -> int:
        """:meth:`of`, or 0 for a shape no plan fits (for a caller that skips those)."""
        try:
            return self.of(trace)
        except BudgetError:
            return 0

    def take(self, trace: Trace) -> int:
        """``trace``'s shape is the current one: its bytes are the budget's from now (a refusal
        changes nothing)."""
        self.bytes = self.of(trace)
        return self.bytes

    def forget_shapes(self) -> None:
        """A relative budget resolves anew for each shape's next trace: the steps now hold what the
        traces before did not count (R3: gradients from a step's start on, accumulating)."""
        self._by_shape.clear()

    def respecify(self, spec: str | int | float, trace: Trace) -> None:
        """Another budget from now (``use_plan(budget=...)``): every shape resolves it anew, and
        ``trace``'s shape is the current one. A malformed or infeasible one fails here."""
        spec = check_budget(spec)
        self._by_shape.clear()
        self.bytes = self._resolve(spec, trace, resolved=None)
        self.spec = spec

    def resolve_device(self, total_bytes: int, others_bytes: int, static_bytes: int) -> None:
        """budget="device", at the first step: the device's ``total_bytes``, less what the process
        holds there beyond the model's static bytes (``others_bytes``: other models, data, the
        CUDA context's allocations through torch), less ``DEVICE_MARGIN`` of the capacity."""
        self.spec = int(total_bytes * (1 - DEVICE_MARGIN)) - others_bytes
        self.device = False
        if self.spec <= static_bytes:
            raise BudgetError(f"budget='device': the device's {format_bytes(total_bytes)} less {DEVICE_MARGIN:.0%} and the "
                              f"{format_bytes(others_bytes)} the process holds leave nothing beyond the model's "
                              f"{format_bytes(static_bytes)}")

    def _resolve(self, spec: str | int | float, trace: Trace, resolved: int | None) -> int:
        """``spec`` in bytes for this step's trace (``resolved``: the bytes it already stands for
        in this run); below what the step can meet, one error that names the runtime's budget and
        says why the step cannot go lower."""
        relative = isinstance(spec, str) and spec.strip().endswith("%")
        if relative:
            # per shape, resolved once, on the shape's first trace: the steps as they run with no
            # block checkpointed (R9's second stage profiles the same shape again, checkpointed:
            # the budget stays what it was, or recomputing would shrink it)
            key = first_bytes(trace)
            out = self._by_shape.get(key)
            if out is None:
                out = self._by_shape[key] = parse_budget(spec, trace, check_feasible=False)
        else:
            out = parse_budget(spec, trace, check_feasible=False) if resolved is None else resolved
        if out >= trace.min_feasible_bytes_movable:  # the state movable where the trace records it (R13)
            self._high = max(self._high, out)
            return out
        if trace.state:
            parse_budget(spec, trace)  # its refusal names the host memory the state needs (R14)
        need, pct = smallest_feasible(trace)
        if relative and resolved is not None and need <= self._high:
            # a later shape whose share is below what it can meet (a small batch, whose transients
            # weigh more) runs at its smallest feasible budget, within the bytes the run already holds
            return need
        passes = int(trace.meta.get("backward_passes", 1))
        if passes > 1:
            why = (f"; its {passes} backward passes read the same saved tensors (retain_graph=True or "
                   "create_graph=True), and each tensor stays on the device from its first unpack to its last")
        elif need >= trace.peak_bytes_no_swap and int(trace.must_resident_bytes.max()) >= trace.saved_bytes_peak:
            # one autograd node reads every saved tensor at once: nothing can be away when it runs
            why = ("; its backward reads every saved tensor at once, as a model compiled whole with "
                   "torch.compile does (one autograd node): compile its blocks separately so that tensors "
                   "can move between them")
        else:
            # R3: where the step is fullest, what no plan moves (outputs not saved, activations'
            # gradients) with what backward reads there
            at = int((trace.other_bytes + trace.must_resident_bytes).argmax())
            other = int(trace.other_bytes[at])
            why = (f"; at its fullest it holds {format_bytes(other)} beyond its saved tensors (outputs not saved, "
                   "activations' gradients: nothing a plan can move)" if other else "")
        if resolved is not None and not relative:
            why += f"; the budget stands for {format_bytes(resolved)} for every shape, and this step's shape needs more"
        raise BudgetError(f"the runtime's budget {spec!r} is below this training step's smallest "
                          f"feasible budget, {format_bytes(need)} ({need} bytes, {pct:.1f}% of its activation "
                          f"peak above static memory, transients included){why}; give at least that")
