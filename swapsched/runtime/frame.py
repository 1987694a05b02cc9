"""What one step under the runtime reads of it: the :class:`StepFrame`, fixed as the step starts.

``PolicyRuntime.step()`` builds a frame; the step classes (``profile_step.py``,
``execute_step.py``) read their configuration and the run's state at that moment from it, never
from the runtime, and hand back what they learned (the trace, its order of first sight) in
themselves, for the runtime to take after the step. What a step must ask the runtime while it runs
goes through :class:`StepHost`'s four calls, and nothing else.

Beside them, what frames a step from outside: its :class:`Phase`, its hooks on autograd's stack
(:class:`SavedTensorHooks`), and the gradients kept to undo a step whose shape is refused
(:class:`GradientsKept`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from swapsched.runtime.casts import no_autocast_cache

if TYPE_CHECKING:
    from swapsched.hardware import Hardware
    from swapsched.runtime.backends import Backend
    from swapsched.runtime.layout import PlanLayout
    from swapsched.runtime.recompute import BlockCheckpoints
    from swapsched.runtime.state_mover import StateMover

__all__ = ["Phase", "StepFrame", "StepHost", "SavedTensorHooks", "GradientsKept"]


class Phase(enum.Enum):
    """What a step under the runtime does; ``PolicyRuntime.phase`` is the next step's."""

    #: record the trace with every saved tensor on the host (``save_on_cpu`` semantics); after
    #: ``profile_steps`` of them the policy plans
    PROFILE = "profile"
    #: execute the plan (R4-R7), and re-time the trace from these steps every ``retime_steps``
    #: (on the emulated device always; on a real one until the first re-timing)
    RETIME = "retime"
    #: execute the plan, as it was last timed
    EXECUTE = "execute"


class GradientsKept:
    """The model's gradients as they were before a step of a new shape reached backward (None as
    a rule, a copy where the loop accumulates), to put back if the runtime refuses that shape."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        self.model = model
        self._grads: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = []

    def keep(self) -> None:
        if self.model is not None:
            self._grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in self.model.parameters()]

    def restore(self) -> None:
        for p, g in self._grads:
            p.grad = g
        self._grads = []

    def drop(self) -> None:
        self._grads = []


class SavedTensorHooks:
    """A step's pack and unpack hooks on autograd's stack, as ``saved_tensors_hooks`` pushes and
    pops them, but by hand: an executing step may take them off after its first saved tensor
    (:meth:`off`, ``StepHost.take_hooks_off``), and the pop at the step's end must not then take
    another's."""

    def __init__(self, pack: Callable[[Any], Any], unpack: Callable[[Any], Any],
                 before_pack: Callable[[], None] | None = None) -> None:
        def checked(t: Any) -> Any:
            if before_pack is not None:
                before_pack()
            return pack(t)

        # Dynamo never traces them: a compiled graph's saved tensors reach them at run time,
        # where Dynamo would otherwise compile their frames (and diverge on their Python state)
        self.pack = torch.compiler.disable(checked)
        self.unpack = torch.compiler.disable(unpack)
        self.on = False
        self.cache = no_autocast_cache()

    def __enter__(self) -> SavedTensorHooks:
        torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)
        self.on = True
        # R12: the hooks make autocast's casts of weights again at unpack (casts.py), so its cache
        # must not hold them for the region; regions entered in the step inherit this
        self.cache.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.on:
            self.off()
        self.cache.__exit__(None, None, None)

    def off(self) -> None:
        """Pop the hooks (from inside the step's first pack: they are the innermost ones)."""
        torch._C._autograd._pop_saved_tensors_default_hooks()
        self.on = False


class StepHost(Protocol):
    """The runtime as a running step may call it."""

    def layout_of_shape(self, first_bytes: int, like: PlanLayout) -> PlanLayout | None:
        """The plan of the shape whose first saved tensor has ``first_bytes``: one profiled before,
        or one predicted from ``like``'s family (a simulation, on the step's thread); None: profile it."""
        ...

    def may_unhook(self, layout: PlanLayout) -> bool:
        """Whether a step of ``layout``'s shape may take its hooks off once its shape is confirmed."""
        ...

    def take_hooks_off(self) -> None:
        """Pop the step's saved-tensor hooks (from inside its first pack: they are the innermost)."""
        ...

    def note_grads(self) -> None:
        """Keep the model's gradients as they are, to put back if the step's new shape is refused."""
        ...


@dataclass(frozen=True)
class StepFrame:
    """One step's view of the runtime (module docstring).

    ``static_keys``: storages already counted in ``static_bytes`` that a step may pack (BatchNorm's
    running stats); ``rebuilt``: block -> the bytes its recompute rebuilds, by the plan (R9);
    ``device_timed``: the step marks its gaps on the device (a real device, until its trace is
    re-timed); ``layout``: the plan an executing step follows (None while profiling); ``state``:
    what moves the training state, where the plan places it (``state_mover.py``)."""

    backend: Backend
    hardware: Hardware
    model: torch.nn.Module | None
    static_bytes: int
    static_keys: frozenset[int]
    min_bytes: int
    strict: bool
    audit: bool
    step: int
    blocks: BlockCheckpoints | None
    rebuilt: Mapping[str, int]
    device_timed: bool
    layout: PlanLayout | None
    host: StepHost
    # the training state the adopted plan moves (R13-R16): the unpack hook tells it where backward is
    state: StateMover | None = None
    # R18: the bytes others hold on the device as the step starts beyond the model's static bytes
    # (FSDP2's unsharded gradients between micro-batches without sync), now and the most a step
    # of the run has started with (what the profiled trace counts in its static bytes, for plans)
    held: tuple[int, int] = (0, 0)
    # R3: the step counts each gradient it makes from its birth, in its other bytes (not static)
    gradients_born: bool = False
