"""R9 in real training: the blocks a plan recomputes run under ``torch.utils.checkpoint``.

A plan's ``recompute`` names blocks of the trace (``Trace.segments``: elements of a
``ModuleList``/``Sequential``, by module path). :class:`BlockCheckpoints` wraps each named
module's ``forward`` in non-reentrant ``torch.utils.checkpoint.checkpoint`` (RNG state preserved,
so dropout recomputes the same mask and gradients stay bit-identical), and takes the wrappers off
again. Under a checkpoint the block saves nothing through the runtime's hooks; its inputs are
saved through them (the checkpoint packs them before it runs the block, and unpacks them when
backward first needs the block), so the plan may swap them as any saved tensor. The members the
recompute rebuilds are held by the checkpoint until the block's backward has used them: the
runtime cannot move them, and counts their bytes in the gap after that unpack (``rebuilt``).

A block checkpointed selectively (R9, selective) runs under the same checkpoint with PyTorch's
selective policy (``create_selective_checkpoint_contexts``). The policy saves exactly the op calls
that made the block's members the plan keeps (the profiling step records which op call made each
storage: ``OpNames.producers``), and recomputes every other op. A random op is always recomputed:
skipping it in the recompute would shift the RNG state for the random ops after it, and dropout
masks would differ. What the policy saves lives in the checkpoint's own cache, outside the
runtime's hooks, from the op's forward until the block's backward is done with it; the
runtime counts those storages (``held``, with a finalizer on each, so a storage counts until it
dies), the audit meter is told of each, and the profiling step counts them as held in the gaps
they span.

A run of single layers (``features.3-7``, as ``checkpoint_sequential`` cuts a Sequential) is not
one module the runtime can wrap: :meth:`BlockCheckpoints.executable` keeps only the blocks that are.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from swapsched.errors import UserError, internal_assert
from swapsched.plan import SwapPlan
from swapsched.runtime.shapes import structure
from swapsched.trace import Trace

__all__ = ["BlockCheckpoints", "OpCall"]

#: An op call within a block's forward, as selective checkpointing counts them: (op, n), the
#: op's ``n``-th call there (``OpNames.producers``)
OpCall = tuple[Any, int]

# the forward policy is told the op's output (as in the torch this project pins; not in older ones):
# the runtime counts what the cache keeps then, and plans no selective block without it
_POLICY_SEES_OUTPUT = "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


@contextmanager
def _stacked(*contexts: AbstractContextManager[Any]) -> Iterator[None]:
    with ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


class _RecomputeMeter(TorchDispatchMode):
    """One recompute of block ``name``, seen from inside: every storage an op makes there is new
    memory (a view of a storage ``known`` already is not), alive until it dies. Its peak is what
    the recompute really holds, the members it rebuilds and its transients, which the owner keeps
    per block (``rebuilt_peak``)."""

    def __init__(self, owner: BlockCheckpoints, name: str):
        super().__init__()
        self.owner, self.name = owner, name
        self.seen: set[int] = set()
        self.alive = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        known = self.owner.known
        # a view of an input is no new memory, whoever owns the input: under FSDP2 the parameters
        # a block reads are storages FSDP all-gathered for backward, which nothing here counts
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                key = st._cdata
                if (key in self.seen or key in inputs or key in self.owner.held_keys
                        or (known is not None and known(key))):
                    continue
                self.seen.add(key)
                n = st.nbytes()
                self.alive += n
                self.peak = max(self.peak, self.alive)
                weakref.finalize(st, self._died, n)
        return out

    def _died(self, n: int) -> None:
        self.alive -= n

    def __exit__(self, *exc: Any) -> Any:
        peaks = self.owner.rebuilt_peak
        peaks[self.name] = max(peaks.get(self.name, 0), self.peak)
        return super().__exit__(*exc)


class BlockCheckpoints:
    """Wraps the plan's blocks of ``model`` in ``torch.utils.checkpoint`` while a plan recomputes them.

    ``entering``: the block whose checkpoint is saving its inputs now (the runtime's pack hook
    reads it: inside a checkpointed block, only those inputs reach the runtime's hooks).
    ``saved``: block -> the op calls its selective checkpoint saves, for the blocks checkpointed
    selectively; ``held`` the bytes of what those checkpoints hold now.
    ``metered``: inside :meth:`metering`, each recompute is watched from inside
    (:class:`_RecomputeMeter`): ``rebuilt_peak`` gets the most bytes each block's recompute held at
    once; ``known`` says which storages are counted already. A profiling step opens the meter and
    closes it as it ends."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.installed: dict[str, tuple[nn.Module, Any]] = {}  # name -> (module, its own instance forward or None)
        self.entering: str | None = None
        self.metered = False
        self.rebuilt_peak: dict[str, int] = {}
        self.known: Callable[[int], bool] | None = None
        self.saved: dict[str, frozenset[OpCall]] = {}
        # the last whole profiling step with no block checkpointed: its structure, and which op call
        # made each saved tensor there (ProfileStep.producers), from which a selective checkpoint
        # knows what to save
        self._producers: tuple[Any, dict[int, tuple[tuple[str, Any, int], ...]]] | None = None
        # storages the selective checkpoints hold (key -> bytes), and the bytes of those that died
        # since ``held`` last looked (finalizers append, maybe on another thread)
        self.held_keys: dict[int, int] = {}
        self._held = 0
        self._held_deaths: deque[int] = deque()

    @contextlib.contextmanager
    def metering(self, known: Callable[[int], bool]) -> Iterator[None]:
        """Watch every recompute while open, ``rebuilt_peak`` afresh (see the class): ``known``
        storages are not new memory."""
        self.metered, self.known = True, known
        self.rebuilt_peak = {}
        try:
            yield
        finally:
            self.metered, self.known = False, None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.installed)

    @property
    def selective(self) -> tuple[str, ...]:
        return tuple(n for n in self.installed if n in self.saved)

    @property
    def held(self) -> int:
        """Bytes the selective checkpoints hold now: what their policy saved, until it dies."""
        deaths = self._held_deaths
        while deaths:
            self._held -= deaths.popleft()
        return self._held

    def executable(self, trace: Trace) -> Trace:
        """``trace`` with only the blocks this model has as one module each; checkpointed
        selectively too where a profiling step of its structure said which op call made each
        member (:meth:`record_producers`), so that the policy can save exactly the kept ones."""
        return trace.with_segments(lambda sg: self._module(sg.name) is not None,
                                   selective=self._made_by(trace) is not None and _POLICY_SEES_OUTPUT)

    def fell_short(self, trace: Trace, budget: int | None) -> bool:
        """R9, selective: the steps as they ran with blocks checkpointed selectively (``trace``)
        cannot meet ``budget``, as the plan made before expected. A selective recompute runs every
        op it does not save, so its transients can exceed the bytes it was planned to rebuild;
        then those blocks are to be checkpointed whole, which frees all of each block."""
        return bool(self.selective) and budget is not None and trace.min_feasible_bytes > budget

    def planned_on(self, trace: Trace) -> Trace:
        """What the policy may plan on: with blocks already checkpointed, ``trace`` is the steps as
        they run so (R9's second stage), and only swaps are planned; else :meth:`executable`."""
        return trace.with_segments(lambda sg: False) if self.names else self.executable(trace)

    @staticmethod
    def rebuilt_bytes(trace: Trace, plan: SwapPlan) -> dict[str, int]:
        """Block -> the bytes ``plan``'s recompute of it rebuilds, until a profile measures them: a
        block checkpointed whole all its members, a selective one only its cheap ones (R9)."""
        segments = {sg.name: sg for sg in trace.segments}
        return {**{name: segments[name].bytes for name in plan.recompute},
                **{name: segments[name].cheap_bytes for name in plan.selective}}

    def record_producers(self, trace: Trace, producers: dict[int, tuple[tuple[str, Any, int], ...]]) -> None:
        """A profiling step's ``trace`` and which op call made each of its saved tensors, per
        module (``ProfileStep.producers``); kept from a whole step with no block checkpointed."""
        if producers and not self.installed:
            self._producers = (structure(trace), producers)

    def _made_by(self, trace: Trace) -> dict[int, tuple[tuple[str, Any, int], ...]] | None:
        if self._producers is None or self._producers[0] != structure(trace):
            return None
        return self._producers[1]

    def selective_saves(self, trace: Trace, plan: SwapPlan) -> dict[str, frozenset[OpCall]]:
        """Per block ``plan`` checkpoints selectively, the op calls that made its kept members
        (the members its recompute does not rebuild): what its policy saves."""
        if not plan.selective:
            return {}
        made_by = self._made_by(trace)
        if made_by is None:
            raise UserError(f"plan {plan.policy!r} checkpoints {len(plan.selective)} block(s) selectively, but no "
                            "profiling step of this trace recorded which op call made each saved tensor; plan on "
                            "runtime.trace after the runtime's own profiling steps")
        segments = {sg.name: sg for sg in trace.segments}
        saved = {}
        for name in plan.selective:
            sg = segments[name]
            kept = set(sg.members) - set(sg.cheap)
            saved[name] = frozenset((op, n) for tid in kept for path, op, n in made_by.get(tid, ()) if path == name)
        return saved

    def _module(self, name: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(name)
        except AttributeError:
            return None

    def install(self, names: Iterable[str], saved: Mapping[str, frozenset[OpCall]] | None = None) -> None:
        """Checkpoint exactly the blocks ``names`` from the next forward on, those in ``saved``
        selectively: they save the op calls given, and recompute the rest."""
        self.remove()
        for name in names:
            module = self._module(name)
            if module is None:
                raise UserError(f"the plan recomputes block {name!r}, which is not a submodule of the runtime's model; "
                                "plan on a trace of this model (SwapRuntime(model=...) profiles it)")
            own = module.__dict__.get("forward")  # a forward set on the instance (a wrapper of the user's) is kept
            module.forward = self._checkpointed(name, module.forward)
            self.installed[name] = (module, own)
        self.saved = dict(saved or {})
        internal_assert(set(self.saved) <= set(self.installed), "blocks checkpointed selectively are checkpointed")

    def remove(self) -> None:
        """Every block runs its own forward again."""
        for module, own in self.installed.values():
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own
        self.installed.clear()
        self.saved = {}

    def _checkpointed(self, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # nothing is saved: nothing to recompute
                return forward(*args, **kwargs)
            outer, self.entering = self.entering, name
            try:
                # the checkpoint saves the block's inputs through the runtime's hooks (they are the
                # only packs the runtime sees while ``entering`` is set); everything the block saves
                # is the checkpoint's, dropped after forward and rebuilt when backward needs it,
                # or (selective) kept in its cache until then. context_fn runs as the checkpoint
                # starts (given only where needed: under torch.compile it must give dispatch modes)
                extra: dict[str, Any] = {"context_fn": lambda: self._contexts(name)} if self.metered or name in self.saved else {}
                return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)
            finally:
                self.entering = outer

        return run

    def _contexts(self, name: str) -> tuple[Any, Any]:
        """The checkpoint's two contexts (one call per forward of the block): its forward's and
        its recompute's."""
        meter = _RecomputeMeter(self, name) if self.metered else None
        if name not in self.saved:
            return nullcontext(), meter if meter is not None else nullcontext()
        caching, cached = create_selective_checkpoint_contexts(self._policy(self.saved[name]))
        # the meter inside the cached mode: it sees what the cache hands back, and counts it not
        return caching, cached if meter is None else _stacked(cached, meter)

    def _policy(self, saved: frozenset[OpCall]) -> Callable[..., CheckpointPolicy]:
        calls: dict[Any, int] = {}  # op -> its calls so far in this forward, as the checkpoint counts them

        def policy(ctx: SelectiveCheckpointContext, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if ctx.is_recompute:
                return CheckpointPolicy.PREFER_RECOMPUTE
            n = calls.get(func, 0)
            calls[func] = n + 1
            # a random op runs again in the recompute, so that the ones after it draw the same numbers
            if (func, n) in saved and torch.Tag.nondeterministic_seeded not in func.tags:
                self._hold(ctx.op_output)
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return policy

    def _hold(self, out: Any) -> None:
        """The checkpoint's cache keeps ``out`` until the block's backward: count its storages
        until they die."""
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in self.held_keys:
                continue
            n = st.nbytes()
            self.held_keys[key] = n
            self._held += n
            weakref.finalize(st, self._held_died, key, n)

    def _held_died(self, key: int, n: int) -> None:
        self.held_keys.pop(key, None)
        self._held_deaths.append(n)
