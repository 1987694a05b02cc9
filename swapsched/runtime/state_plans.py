"""The runtime's side of the training state (R13-R17): whether the state must move under the
run's budget, the trace with the state recorded where it must, the mover for each adopted plan
(handing what rests on the host from one mover to the next), and what ``close()`` leaves.

:class:`RuntimeState` is ``PolicyRuntime``'s one home for these decisions; what moves the state
within and between steps is ``state_mover.py`` and ``state_rest.py``.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import torch

from swapsched.budget import format_bytes, parse_budget
from swapsched.errors import UserError, present
from swapsched.plan import SwapPlan
from swapsched.runtime.backends import Backend
from swapsched.runtime.budgets import ShapeBudgets
from swapsched.runtime.disk_store import DiskStore
from swapsched.runtime.optimizer_steps import OptimizerSteps
from swapsched.runtime.profiler import optimizer_state_kind, state_groups, static_bytes_of
from swapsched.runtime.replicas import gradients_complete_at_backward_end, replica
from swapsched.runtime.shards import held_between_micro_batches, is_sharded
from swapsched.runtime.state_disk import LIVE_DISK_TIERS
from swapsched.runtime.state_mover import StateMover
from swapsched.runtime.state_rest import to_device
from swapsched.state import FROZEN_SUFFIX, MEASURED_OPTIMIZER_RATES, SHARD_PLACEMENTS, group_name
from swapsched.trace import STATE_GRADIENTS_BORN, Trace

__all__ = ["RuntimeState"]


class RuntimeState:
    """The model, its optimizer and the mover the adopted plan needs (module docstring)."""

    def __init__(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None, backend: Backend,
                 budgets: ShapeBudgets, disk: str | Path | None = None) -> None:
        self.model, self.optimizer, self.backend, self.budgets = model, optimizer, backend, budgets
        self.mover: StateMover | None = None
        # R19: the files the optimizer state rests in where a plan puts it on the disk
        self.disk = None if disk is None else DiskStore(disk, pin=not backend.emulated)
        # whether a DDP ran the model's forward (replicas.py): its gradients complete as backward ends
        self.data_parallel = False
        self._held_most = 0  # held_by_others
        self._accumulates = False  # a step began with gradients (counts_gradients_from_birth)
        # calls of the model's forward that Dynamo traced (torch.compile): the side effect of the
        # traced hook replays at each compiled call
        self._compiled: list[bool] = []
        self._forward_hook = None if model is None else model.register_forward_pre_hook(self._note_forward)
        # R15: the user's optimizer steps, timed (optimizer_steps.py)
        self.optimizer_steps: OptimizerSteps | None = None if optimizer is None else OptimizerSteps(optimizer, backend)

    def _note_forward(self, module: torch.nn.Module, args: object) -> None:
        # traced by Dynamo, or run by it as a frame it could not trace (a graph break before
        # this hook): either way under torch.compile (Dynamo's frame callback is set)
        if torch.compiler.is_compiling() or torch._C._dynamo.eval_frame.get_eval_frame_callback() is not None:
            self._compiled.append(True)
            return
        if not self.data_parallel and replica(module) is not None:
            self.data_parallel = True

    def optimizer_stepped(self, profiling: bool) -> None:
        """As a step begins: the user's optimizer step since the last one (R15), kept for the trace
        where no plan was made before it (``profiling``), with where it stepped the state."""
        if self.optimizer_steps is not None:
            self.optimizer_steps.settle(profiling, on_host=self.mover is not None)

    def optimizer_step_s(self) -> float | None:
        """The user's optimizer step since the last training step began (None: none yet)."""
        return None if self.optimizer_steps is None else self.optimizer_steps.last_s()

    def held_by_others(self) -> tuple[int, int]:
        """R18: the bytes FSDP2 holds on the device now between micro-batches (its unsharded
        gradients, ``shards.held_between_micro_batches``), and the most a step of this run has
        started with (the accumulation recurs: plans leave room for it)."""
        if self.model is None or not self.sharded:
            return 0, 0
        now = held_between_micro_batches(self.model)
        self._held_most = max(self._held_most, now)
        return now, self._held_most

    @property
    def counts_gradients_from_birth(self) -> bool:
        """R3: whether a step counts each gradient it makes from its birth, in its other bytes:
        where the state cannot move (the model and its optimizer under a byte budget, R13, count
        gradients as the state's, static), FSDP2 does not shard it (its gradients are FSDP2's),
        and no step of the run has begun with gradients (accumulating: its forward holds them)."""
        return self.model is not None and not self._byte_budget() and not self.sharded and not self._accumulates

    @property
    def state_gradients_born(self) -> bool:
        """R3 with R13: whether a trace that records the state counts the gradients as the step
        makes them, each from its group's backward (``Trace.state_gradients_born``): where FSDP2
        does not shard them, no DDP holds them in its buckets, and no step has begun with them."""
        return (self.model is not None and self._byte_budget() and not self.sharded and not self.data_parallel
                and not self._accumulates)

    def gradients_at_start(self, state_trace_born: bool) -> bool:
        """As a step begins: whether it is the run's first to begin with gradients where steps
        counted them from their birth (R3): in their other bytes, or in the state of the trace
        planned on (``state_trace_born``). From then on they count as static; a plan made before
        is for steps that held less, and the caller profiles again."""
        in_other = self.counts_gradients_from_birth
        if not (in_other or self.state_gradients_born) or not any(
                p.grad is not None for p in present(self.model, "the model").parameters()):
            return False
        self._accumulates = True  # a state trace made from now on counts them static too
        self.budgets.forget_shapes()  # a relative one is a share of the steps as they now run
        return in_other or state_trace_born

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 (or tensor parallel) shards the model's parameters (R18)."""
        return self.model is not None and is_sharded(self.model)

    @property
    def distributed(self) -> bool:
        """Whether the model trains on several ranks as one (DDP ran its forward, or FSDP2 shards it)."""
        return self.data_parallel or self.sharded

    def refuse_compiled(self) -> None:
        """Before a step's first saved tensor: a model called through ``torch.compile`` saves its
        compiled graph's tensors, which the hooks runtime cannot plan; refused in one line."""
        if self._compiled:
            self._compiled.clear()
            raise UserError("the model runs through torch.compile, whose graphs the hooks runtime cannot plan: compile "
                            "it with swapsched's backend instead, torch.compile(model, backend=swapsched.CompileBackend("
                            "budget=..., inner='inductor')), without SwapRuntime (docs/guide/compile.md)")

    def attach(self, optimizer: torch.optim.Optimizer, planned: bool) -> int:
        """``PolicyRuntime.attach_optimizer``: the optimizer, and the static bytes it makes."""
        if self.optimizer is not optimizer:
            if self.optimizer is not None or planned or self.model is None:
                raise UserError("attach_optimizer() gives a runtime made with a model and no optimizer its optimizer, "
                                "before its first plan; give it as SwapRuntime(model=..., optimizer=...) otherwise")
            self.optimizer = optimizer
            self.optimizer_steps = OptimizerSteps(optimizer, self.backend)
        return static_bytes_of(present(self.model, "the model"), optimizer)

    def _byte_budget(self) -> bool:
        return self.model is not None and self.optimizer is not None and not (self.budgets.relative or self.budgets.device)

    def profile_with_state_on_host(self, static_bytes: int, host_budget: int | None) -> None:
        """Before a profiling step: under a byte budget below the static bytes (parameters,
        gradients, optimizer state) the state cannot stay on the device, and the profiling steps
        run with every group on the host, fetched on demand (R17), where the host budget (R11)
        holds all of it; else they run with it where it is, and the plan keeps to the host budget."""
        if self.mover is not None or not self._byte_budget() or parse_budget(self.budgets.spec) >= static_bytes:
            return
        if is_sharded(present(self.model, "the model")):  # shards stay where FSDP2 holds them (SHARD_PLACEMENTS)
            return
        if host_budget is not None and static_bytes_of(present(self.model, "the model"), self.optimizer) > host_budget:
            return
        # every group full, fetched on demand and copied in the calling thread, not on the
        # throttled engines: no plan yet, and the profiling steps' gaps are the trace's compute
        model = present(self.model, "the model")
        groups = {group_name(name) + ("" if p.requires_grad else FROZEN_SUFFIX)  # R13: frozen ones too
                  for name, mod in model.named_modules() for p in mod.parameters(recurse=False)}
        self.mover = StateMover(model, present(self.optimizer, "the optimizer"), self.backend, (), {g: "full" for g in groups})
        self.mover.eager = True

    def with_state(self, trace: Trace) -> Trace:
        """R13: ``trace`` with the model's training state per group where the state must move:
        under a byte budget that no plan of the activations alone meets
        (``Trace.min_feasible_bytes``). The state's bytes are in the static bytes already."""
        if trace.state or not self._byte_budget():
            return gradients_complete_at_backward_end(trace) if self.data_parallel else trace
        if parse_budget(self.budgets.spec, trace, check_feasible=False) >= trace.min_feasible_bytes:
            return trace
        model, optimizer = present(self.model, "the model"), present(self.optimizer, "the optimizer")
        kind = optimizer_state_kind(optimizer)
        meta = {**trace.meta, "optimizer": kind, STATE_GRADIENTS_BORN: self.state_gradients_born}
        # R18: what the runtime carries out on FSDP2's shards (nothing on the disk); R19: what it
        # rests on the disk
        if is_sharded(model):
            meta["placements"] = list(SHARD_PLACEMENTS)
        meta["disk_tiers"] = [] if is_sharded(model) else list(LIVE_DISK_TIERS)
        # R15: the rates the user's optimizer stepped at in the profiling steps (one rank's alone)
        rates = None if self.distributed or self.optimizer_steps is None else self.optimizer_steps.rates(self.backend.emulated)
        if rates is not None:
            meta[MEASURED_OPTIMIZER_RATES] = rates
        trace = replace(trace, state=state_groups(model, trace, kind), meta=meta)
        return gradients_complete_at_backward_end(trace) if self.data_parallel else trace

    def place(self, plan: SwapPlan, trace: Trace) -> None:
        """The mover for ``plan``'s placement: made, kept, or taken off. A change of placement
        hands what rests on the host from one mover to the next, so that no moment of it holds
        the whole state on the device."""
        placement = {g: w for g, w in plan.placement().items() if w != "device"}
        tiers = plan.on_disk()
        if self.mover is not None and self.mover.placement == placement and self.mover.disk_tiers == tiers:
            return
        if tiers and self.disk is None:
            raise UserError(f"plan {plan.policy!r} rests state on the disk (R19): give the runtime a directory for it "
                            "(SwapRuntime(disk='/path/on/nvme', disk_budget=...))")
        if placement and (self.model is None or self.optimizer is None):
            raise UserError(f"plan {plan.policy!r} moves the training state (R13): give the runtime the model "
                            "and its optimizer (SwapRuntime(model=..., optimizer=...))")
        old, self.mover = self.mover, None
        handover = old.hand_over() if old is not None else None
        try:
            if placement:
                self.mover = StateMover(present(self.model, "the model"), present(self.optimizer, "the optimizer"),
                                        self.backend, trace.state, placement, handover,
                                        None if self.disk is None else (self.disk, tiers))
        finally:
            if handover is not None and old is not None:  # what the new placement keeps on the device, back there
                to_device(old.optimizer, old.device, handover, keep=set(self.mover.params) if self.mover else set())

    def close(self) -> None:
        """The state back on the device where the device has room for it (on CUDA, one that does
        not fit stays on the host, as ``p.data``, with a warning)."""
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        if self.optimizer_steps is not None:
            self.optimizer_steps.remove()
        mover, self.mover = self.mover, None
        if mover is None:
            self._close_disk()
            return
        need = mover.host_bytes()
        total, held = (0, 0) if self.backend.emulated else self.backend.memory()
        if not self.backend.emulated and need > total - held:
            mover.hand_over()  # every tensor stays where it rests
            warnings.warn(f"SwapRuntime.close(): the {format_bytes(need)} of parameters, gradients and optimizer "
                          f"state on the host do not fit the device's {format_bytes(total - held)} free: they stay "
                          "on the host (p.data is a host tensor there)", stacklevel=3)
        else:
            mover.remove()
        self._close_disk()

    def _close_disk(self) -> None:
        """R19: the run's files removed (the movers brought what rested there back first)."""
        if self.disk is not None:
            self.disk.close()
            self.disk = None
