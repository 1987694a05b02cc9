"""Profile one real training step into a Trace, through ``saved_tensors_hooks`` (DESIGN.md "Trace").

``profile(model, inputs, loss_fn)`` runs the step twice on a real device: first a *structure*
pass under a dispatch mode that names the aten op behind each saved tensor, a
``FlopCounterMode`` that counts FLOPs per gap and the transient meter that measures what each gap
holds beyond the saved tensors (R3's other bytes, ``transients.py``; on ``meta`` too), then a *timing* pass with nothing but light hooks
(``perf_counter`` on the CPU; one CUDA event per hook on a GPU, read after a single synchronize).
Gradients, RNG and buffers are restored between the passes, so after ``profile`` the model holds
exactly the gradients of one plain training step. On the ``meta`` device only the structure pass
runs and the gaps are timed by roofline for a target :class:`~swapsched.hardware.Hardware`.

What the hooks record, and how a saved tensor is identified (R2), is ``recorder.py``'s; the
runtime's own profiling steps (``profile_step.py``) record with the same pieces. Parameters
(leaves that require grad, and views of them) and buffers are not saved tensors: they are counted
in ``static_bytes`` together with optimizer state (:func:`static_bytes_of`), and so are the
gradients where the trace records the state (R13); without it, a gradient the step makes is one of
its other bytes from its birth (R3).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from swapsched.attention import AttentionKernel
from swapsched.errors import UserError, present
from swapsched.hardware import DEFAULT_CPU_HARDWARE, DEFAULT_GPU_HARDWARE, Hardware, load_hardware
from swapsched.precision import Precision, autocast_for
from swapsched.runtime.casts import no_autocast_cache
from swapsched.runtime.recorder import ModulePath, OpNames, ProfileError, TraceRecorder, storage_key
from swapsched.runtime.shards import local_of, offloaded_by_fsdp
from swapsched.runtime.transients import OTHER_MEASURED, TransientMeter
from swapsched.state import FROZEN_SUFFIX, StateGroup, group_name, optimizer_kind
from swapsched.trace import GRADIENTS_BORN, STATE_GRADIENTS_BORN, Trace

__all__ = ["profile", "static_bytes_of", "state_groups", "optimizer_state_kind", "with_gradients", "static_gradients",
           "born_gradient_bytes"]

#: torch.optim classes -> the optimizer kind the trace records their state as (state.OPTIMIZERS)
_KINDS = {"Adam": "adamw", "AdamW": "adamw", "NAdam": "adamw", "RAdam": "adamw", "Adamax": "adamw", "SGD": "sgd",
          "RMSprop": "sgd", "Adagrad": "sgd", "Adafactor": "adafactor"}


def optimizer_state_kind(optimizer: torch.optim.Optimizer) -> str:
    """The ``state.OPTIMIZERS`` kind whose per-parameter state ``optimizer`` keeps."""
    name = type(optimizer).__name__
    for klass in type(optimizer).__mro__:
        if klass.__name__ in _KINDS:
            name = klass.__name__
            break
    else:
        raise UserError(f"moving the training state needs to know what {type(optimizer).__name__} keeps per "
                        f"parameter; supported: torch.optim's {', '.join(sorted(_KINDS))} (or subclasses of them)")
    if name == "SGD" and not any(g.get("momentum", 0) for g in optimizer.param_groups):
        return "none"
    return _KINDS[name]



def _optimizer_state_bytes(optimizer: torch.optim.Optimizer | None, host: set[int]) -> int:
    """The optimizer's state bytes, but for the parameters (by id) in ``host`` (FSDP2's on the host, R18)."""
    if optimizer is None:
        return 0
    state = [v for p, s in optimizer.state.items() if id(p) not in host for v in s.values() if torch.is_tensor(v)]
    if state:
        return sum(local_of(v).numel() * v.element_size() for v in state)
    # state is created lazily at the first step: count what it will hold (an optimizer whose kind
    # is not known counts none, as before the state could move)
    try:
        kind = optimizer_state_kind(optimizer)
    except UserError:
        return 0
    return sum(_optimizer_bytes(p, kind) for g in optimizer.param_groups for p in g["params"] if id(p) not in host)


def _optimizer_bytes(p: torch.Tensor, kind: str) -> int:
    """The bytes optimizer ``kind`` keeps for ``p``, in its dtype as torch.optim does (Adafactor:
    a row and a column per matrix, a whole copy per vector)."""
    p = local_of(p)  # a shard's own elements (R18)
    size = p.element_size()
    if kind == "adafactor":
        return size * (p.shape[0] + p[0].numel()) if p.dim() >= 2 else size * p.numel()
    return int(optimizer_kind(kind).states_per_param * p.numel()) * size


def state_groups(model: nn.Module, trace: Trace, optimizer: str) -> tuple[StateGroup, ...]:
    """R13: the model's parameters per group (``state.group_name`` of their module; the frozen
    ones in a group of their own, ``FROZEN_SUFFIX``),
    each storage once (a tied weight counts in the group that registers it first), with their
    gradients, the state ``optimizer`` keeps for them in their dtype, as torch.optim does
    (``state.OPTIMIZERS``; Adafactor: a row and a column per matrix, a whole copy per vector)
    and their events in ``trace``."""
    kind = optimizer_kind(optimizer)
    seen: set[int] = set()
    sizes: dict[str, list[int]] = {}
    host = offloaded_by_fsdp(model)  # FSDP2's to move, on the host (R18)
    for mod_name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            if storage_key(p) in seen or id(p) in host:
                continue
            seen.add(storage_key(p))
            nb = local_of(p).untyped_storage().nbytes()  # a shard's own bytes (R18), not its wrapper's
            # a frozen parameter (a LoRA model's base weight): its own group, no gradient or state
            trains = p.requires_grad
            acc = sizes.setdefault(group_name(mod_name) + ("" if trains else FROZEN_SUFFIX), [0, 0, 0, 0, 0])
            for i, v in enumerate((local_of(p).numel(), nb, nb if trains else 0, _optimizer_bytes(p, kind.name) if trains else 0, 1)):
                acc[i] += v
    out = []
    for name, (params, param_bytes, grad_bytes, optim_bytes, tensors) in sizes.items():
        fa, fe, ba, ga = trace.group_events(name)
        out.append(StateGroup(name, params, param_bytes, grad_bytes, optim_bytes, fa, fe, ba, ga,
                              frozen=name.endswith(FROZEN_SUFFIX), tensors=tensors))
    return tuple(out)


def static_bytes_of(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Parameters + their gradients + buffers + optimizer state, each storage once; not those
    FSDP2's CPUOffloadPolicy keeps on the host (R18)."""
    seen: set[int] = set()
    total = 0
    host = offloaded_by_fsdp(model)
    for p in model.parameters():
        k = storage_key(p)
        if k in seen or id(p) in host:
            continue
        seen.add(k)
        nb = local_of(p).untyped_storage().nbytes()  # a shard's own bytes (R18), not its wrapper's
        total += nb * (2 if p.requires_grad else 1)
    for b in model.buffers():
        k = storage_key(b)
        if k not in seen:
            seen.add(k)
            total += b.untyped_storage().nbytes()
    return total + _optimizer_state_bytes(optimizer, host)


def with_gradients(model: nn.Module) -> set[int]:
    """The ids of ``model``'s parameters that hold a gradient now (as a step begins: R3)."""
    return {id(p) for p in model.parameters() if p.grad is not None}


def static_gradients(model: nn.Module, had: set[int] | None) -> list[torch.Tensor]:
    """The gradients the step's static bytes count: every one ``model`` holds now, or (R3, from
    their birth) only those of the parameters that held one as the step began (``had``:
    :func:`with_gradients` then)."""
    return [p.grad for p in model.parameters() if p.grad is not None and (had is None or id(p) in had)]


def born_gradient_bytes(model: nn.Module, had: set[int]) -> int:
    """R3, gradients from their birth: what :func:`static_bytes_of` counts for the gradients the
    step made, of the parameters that had none as it began (``had``: :func:`with_gradients`
    then) and hold one now; the step's static bytes leave these out, its other bytes count them."""
    seen: set[int] = set()
    host = offloaded_by_fsdp(model)
    total = 0
    for p in model.parameters():
        k = storage_key(p)
        if k in seen or id(p) in host or not p.requires_grad:
            continue
        seen.add(k)
        if p.grad is not None and id(p) not in had:
            total += local_of(p).untyped_storage().nbytes()
    return total


def _snapshot(model: nn.Module) -> tuple[Any, ...]:
    grads = [(p, None if p.grad is None else p.grad.clone()) for p in model.parameters()]
    buffers = [(b, b.clone()) for b in model.buffers()]
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return grads, buffers, torch.get_rng_state(), cuda_rng


def _restore(snap: tuple[Any, ...]) -> None:
    grads, buffers, rng, cuda_rng = snap
    with torch.no_grad():
        for p, g in grads:
            p.grad = g
        for b, v in buffers:
            b.copy_(v)
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)


def profile(
    model: nn.Module,
    inputs: tuple[Any, ...] | Any,
    loss_fn: Callable[[Any], torch.Tensor] = lambda out: out.sum(),
    optimizer: torch.optim.Optimizer | None = None,
    device: str | torch.device | None = None,
    *,
    name: str = "model",
    hardware: Hardware | str | None = None,
    precision: Precision | None = None,
    attention: str | None = None,
    state: str | None = None,
) -> Trace:
    """One training step of ``loss_fn(model(*inputs)).backward()`` as a Trace.

    ``device`` defaults to where the model's parameters are. On ``meta`` the trace is timed by
    roofline for ``hardware`` (default ``h100-pcie5``); elsewhere gaps are measured, and a
    ``hardware`` argument retimes the measured trace by roofline afterwards.

    ``precision``: the forward runs under its autocast (``Precision("bf16", amp=True)``; the
    model's parameters are already in its ``param_dtype``); None: as the model is. ``attention``:
    every ``scaled_dot_product_attention`` call runs as this kernel would on ``hardware``
    (``"flash"``, ``"mem-efficient"``, ``"math"``; ``"auto"``: SDPA's own choice there, see
    swapsched/attention.py); None: as SDPA runs on ``device``. The trace's ``meta`` records both.

    ``state``: an optimizer's name (``state.OPTIMIZERS``: adamw, sgd, adafactor, none): the trace
    records the training state per group (R13), with the state that optimizer keeps, and
    ``optimizer`` is not read; None: everything in ``static_bytes``, with ``optimizer``'s state.
    """
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    params = list(model.parameters())
    dev = torch.device(device) if device is not None else (params[0].device if params else torch.device("cpu"))
    if params and params[0].device.type != dev.type:
        raise ProfileError(f"{name}: the model is on {params[0].device} but profiling was asked on {dev}; move it first")
    static = static_bytes_of(model, None if state else optimizer)  # with state: the optimizer's is added per group
    model.train()
    target = load_hardware(hardware or (DEFAULT_GPU_HARDWARE if dev.type in ("meta", "cuda") else DEFAULT_CPU_HARDWARE))
    step_meta: dict[str, Any] = {} if precision is None else precision.describe()

    def run(rec: TraceRecorder, kernels: AttentionKernel | None) -> None:
        rec.start()
        with rec.hooks(), no_autocast_cache():  # R12: each cast is held only while it is used
            with ExitStack() as region:
                if kernels is not None:  # entered first: under MetaAutocast it sees SDPA's inputs already cast
                    region.enter_context(kernels)
                if precision is not None:
                    region.enter_context(autocast_for(precision, dev))
                loss = loss_fn(model(*inputs))
            loss.backward()  # outside autocast, as torch's AMP recipe runs it

    def kernel_mode() -> AttentionKernel | None:
        return None if attention is None else AttentionKernel(None if attention == "auto" else attention, target)

    # structure pass: op names, FLOPs per gap, module paths
    snap = _snapshot(model) if dev.type != "meta" else None
    ops, flops = OpNames(), FlopCounterMode(display=False)
    # R3: without the state (R13), each gradient the step makes is an other byte from its birth
    born_mode, had = not state, with_gradients(model)
    transients = TransientMeter(lambda: len(structure.kinds), workspace=dev.type == "cuda", grads_born=born_mode)  # R3's other bytes, per gap
    with ExitStack() as stack:
        mp = stack.enter_context(ModulePath(model))
        stack.enter_context(flops)
        stack.enter_context(ops)
        stack.enter_context(transients)
        transients.hook_gradients(params if born_mode else (), stack)  # where each is born (TransientMeter.births)
        structure = TraceRecorder(None, ops=ops, flops=flops, modules=mp, transients=transients)
        kernels = kernel_mode()
        run(structure, kernels)
    if kernels is not None:
        # what ran, per kernel ({} where the model never called SDPA: its own attention code)
        step_meta.update(attention=dict(sorted(kernels.used.items())), attention_requested=attention)
    # counted in static: every gradient with the state; without, those there before the step
    static -= born_gradient_bytes(model, had) if born_mode else 0
    structural = structure.finish(name, str(dev), static, "roofline", static_tensors=static_gradients(model, had if born_mode else None))
    transients.close()
    structural = replace(structural, meta={**structural.meta, **step_meta})

    if dev.type == "meta":
        return _with_state(model, replace(structural.retimed(target), device=f"meta->{target.name}"), state, had)

    _restore(present(snap, "the model's state before the structural step"))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    timing = TraceRecorder("cuda" if dev.type == "cuda" else "cpu")
    run(timing, kernel_mode())
    measured = timing.finish(name, str(dev), static, "measured")
    if [(e.kind, e.tensor) for e in measured.events] != [(e.kind, e.tensor) for e in structural.events]:
        raise ProfileError(
            f"{name}: two runs of the same step saved different tensors (data-dependent control flow?); "
            "profile a step whose saved tensors do not depend on the data"
        )
    events = tuple(replace(m, flops=s.flops, other_bytes=s.other_bytes)
                   for m, s in zip(measured.events, structural.events, strict=False))
    trace = replace(
        measured, tensors=structural.tensors, events=events,
        meta={**measured.meta, **step_meta, "tail_flops": structural.meta["tail_flops"],
              OTHER_MEASURED: structural.meta.get(OTHER_MEASURED, False),
              **{k: structural.meta[k] for k in (GRADIENTS_BORN,) if k in structural.meta}},
    )
    if hardware is not None:
        trace = trace.retimed(load_hardware(hardware))
    return _with_state(model, trace, state, had)


def _with_state(model: nn.Module, trace: Trace, state: str | None, had: set[int]) -> Trace:
    """``trace`` with the model's state per group (R13); its static bytes gain the optimizer's.
    A step that began with no gradient (``had``: :func:`with_gradients` then) makes each one in
    its backward: R3 counts the state's from their birth there."""
    if not state:
        return trace
    groups = state_groups(model, trace, state)
    return replace(trace, static_bytes=trace.static_bytes + sum(g.optim_bytes for g in groups), state=groups,
                   meta={**trace.meta, "optimizer": state, STATE_GRADIENTS_BORN: not had})
