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

A run of single layers (``features.3-7``, as ``checkpoint_sequential`` cuts a Sequential) is not
one module the runtime can wrap: :meth:`BlockCheckpoints.executable` keeps only the blocks that are.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from swapsched.errors import UserError
from swapsched.trace import Trace

__all__ = ["BlockCheckpoints"]


class _RecomputeMeter(TorchDispatchMode):
    """One recompute of block ``name``, seen from inside: every storage an op makes there is new
    memory (a view of a storage ``known`` already is not), alive until it dies. Its peak is what
    the recompute really holds, the members it rebuilds and its transients, which the owner keeps
    per block (``rebuilt_peak``); ``watch`` (the audit meter) is told of each storage."""

    def __init__(self, owner: BlockCheckpoints, name: str):
        super().__init__()
        self.owner, self.name = owner, name
        self.seen: set[int] = set()
        self.alive = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        known, watch = self.owner.known, self.owner.watch
        # a view of an input is no new memory, whoever owns the input: under FSDP2 the parameters
        # a block reads are storages FSDP all-gathered for backward, which nothing here counts
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                key = st._cdata
                if key in self.seen or key in inputs or (known is not None and known(key)):
                    continue
                self.seen.add(key)
                n = st.nbytes()
                self.alive += n
                self.peak = max(self.peak, self.alive)
                weakref.finalize(st, self._died, n)
                if watch is not None:
                    watch(st, n)
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
    ``metered``: while True, each recompute is watched from inside (:class:`_RecomputeMeter`):
    ``rebuilt_peak`` gets the most bytes each block's recompute held at once, and ``watch``, when
    set, is told of every storage it made; ``known`` says which storages are counted already."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.installed: dict[str, tuple[nn.Module, Any]] = {}  # name -> (module, its own instance forward or None)
        self.entering: str | None = None
        self.metered = False
        self.rebuilt_peak: dict[str, int] = {}
        self.watch: Callable[[Any, int], None] | None = None
        self.known: Callable[[int], bool] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.installed)

    def executable(self, trace: Trace) -> Trace:
        """``trace`` with only the blocks this model has as one module each, recomputed whole:
        selective checkpointing (R9, selective) is planned, not executed here. PyTorch's keeps the
        outputs it saves in the checkpoint's own cache, outside the saved-tensor hooks, where the
        runtime's accounting and the audit meter would not see them."""
        return trace.with_segments(lambda sg: self._module(sg.name) is not None, selective=False)

    def _module(self, name: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(name)
        except AttributeError:
            return None

    def install(self, names: Iterable[str]) -> None:
        """Checkpoint exactly the blocks ``names`` from the next forward on."""
        self.remove()
        for name in names:
            module = self._module(name)
            if module is None:
                raise UserError(f"the plan recomputes block {name!r}, which is not a submodule of the runtime's model; "
                                "plan on a trace of this model (SwapRuntime(model=...) profiles it)")
            own = module.__dict__.get("forward")  # a forward set on the instance (a wrapper of the user's) is kept
            module.forward = self._checkpointed(name, module.forward)
            self.installed[name] = (module, own)

    def remove(self) -> None:
        """Every block runs its own forward again."""
        for module, own in self.installed.values():
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own
        self.installed.clear()

    def _checkpointed(self, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # nothing is saved: nothing to recompute
                return forward(*args, **kwargs)
            outer, self.entering = self.entering, name
            try:
                # the checkpoint saves the block's inputs through the runtime's hooks (they are the
                # only packs the runtime sees while ``entering`` is set); everything the block saves
                # is the checkpoint's, dropped after forward and rebuilt when backward needs it
                # context_fn runs as the checkpoint starts; its second context wraps the recompute
                extra = {"context_fn": lambda: (nullcontext(), _RecomputeMeter(self, name))} if self.metered else {}
                return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)
            finally:
                self.entering = outer

        return run
