"""R3's other bytes, measured: the device memory a step holds beyond its saved tensors.

Between two saved-tensor hooks, a step also holds what no hook sees: outputs it has not saved
yet or never will (a convolution's output before the ReLU that saves its own), the gradients of
activations flowing through backward, an op's scratch tensors that torch makes through the
dispatcher, what a checkpoint's recompute rebuilds, what a selective checkpoint keeps. A
convolution's backward holds its output gradient, its input gradient and its saved input at once;
on a convnet these come to a quarter of the step's peak, and a plan that does not count them
overruns its budget.

:class:`TransientMeter` is a dispatch mode entered for a whole profiled step. Every storage an op
makes (not a view of an input's) is timed from the op to its death by a finalizer, with the hook
call it happened before. At the end, the storages that became trace tensors (their bytes are the
trace's, R2) or are counted in ``static_bytes`` (parameters' gradients, where the step counts
them as the training state's: R13) are taken out, and what remains gives, for each hook call, the
most bytes alive in the gap before it.

What a kernel allocates without the dispatcher (cuDNN's workspace, oneDNN's scratchpads) is not
an op's output. On CUDA (``workspace=True``) the caching allocator's counters around each op add
it, as a spike in the op's gap; on the CPU it is not seen. The same measurement runs on ``meta``,
where the storages have their sizes but no memory.

The same mode tallies the collectives the step's ops run (``COLLECTIVES``: DDP's all-reduces,
FSDP2's all-gathers and reduce-scatters, R18), which the step's report gives per rank.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from swapsched.runtime.mode_time import ModeTime

__all__ = ["TransientMeter", "RUNTIME_ALLOCATING", "runtime_allocation", "OTHER_MEASURED", "COLLECTIVES"]

#: The trace meta key that says whether its events' other bytes were measured by this meter (a
#: whole step) or only sampled (a step handed over mid-step, which cannot enter a dispatch mode):
#: ``shapes.py`` predicts a size's other bytes from measured traces only.
OTHER_MEASURED = "other_measured"

#: Set (``RUNTIME_ALLOCATING.on = True``) around the runtime's own allocations, which no meter of the
#: step counts (this one, ``swapsched run --compare``'s): the host pool's buffers (on the emulated
#: device host and "device" are both the CPU), and the device storage a state mover makes for a
#: parameter it fetches (R17: a profiled trace counts the state by its placement, not in its
#: other bytes; the audit meter adds the mover's bytes through :meth:`TransientMeter.shift`).
RUNTIME_ALLOCATING = threading.local()


@contextlib.contextmanager
def runtime_allocation() -> Iterator[None]:
    """What is allocated inside is the runtime's own (:data:`RUNTIME_ALLOCATING`)."""
    RUNTIME_ALLOCATING.on = True
    try:
        yield
    finally:
        RUNTIME_ALLOCATING.on = False


#: c10d's collective ops by kind, with the argument whose tensors are the payload: what an
#: all-gather gathered, what a reduce-scatter reduced, the tensors an all-reduce reduced (DDP's
#: buckets; FSDP2's all-gathers and reduce-scatters)
COLLECTIVES = {
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1), "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
}


class TransientMeter(TorchDispatchMode):
    """Every storage an op makes while the mode is entered, timed by hook call (see the module).

    ``calls``: how many saved-tensor hook calls the step has made so far (the gap an allocation
    falls in). ``paused``: the runtime's own hooks are copying; their ops are not the step's.
    :meth:`saved` is told of each packed tensor and its id; :meth:`per_call` gives the result."""

    def __init__(self, calls: Callable[[], int], *, workspace: bool = False, grads_born: bool = False) -> None:
        super().__init__()
        self.calls = calls
        # R3, gradients from their birth: a gradient autograd makes in the step is one of its
        # other bytes from the op that made it on (the step's static bytes leave it out); else it
        # is the state's, in the static bytes all step, and left out here
        self.grads_born = grads_born
        self.births: list[tuple[int, int]] = []  # (hook calls so far, bytes): each gradient made, grads_born
        # on CUDA: each op's working memory beyond its outputs, from the caching allocator's
        # counters around it (the counters' peak is reset per op: a profiled step's own peak is
        # not the run's then)
        self.workspace = workspace
        self.paused = False
        self._seq = 0
        self._live: dict[int, int] = {}  # storage key -> seq of the live storage made here
        # (hook calls so far, seq, +bytes or -bytes) in time order; finalizers may append from a
        # copy thread (the CPU backend drops a source there), and a deque's append is atomic
        self._log: deque[tuple[int, int, int]] = deque()
        self._saved: dict[int, list[int]] = {}  # trace id in order of first sight -> seqs of its storages
        self._grads: set[int] = set()  # seqs of storages autograd took as a parameter's gradient
        self._finalizers: list[weakref.finalize] = []
        # the collectives the ops ran, by kind: [how many, payload bytes] (R18; COLLECTIVES)
        self.collectives: dict[str, list[int]] = {}
        self.timer: ModeTime | None = None  # charged with this mode's own time around each op (mode_time.py)
        self._op_s = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.timer is None or self.paused:
            return self._dispatch(func, args, kwargs)
        # its own time around the op, for the profiling step's gaps to leave out (mode_time.py):
        # the op's is inside _dispatch's call of it, charged back as the inner time
        t0 = time.perf_counter()
        self._op_s = 0.0
        out = self._dispatch(func, args, kwargs)
        self.timer.own_s += time.perf_counter() - t0 - self._op_s
        self.timer.entries += 1
        return out

    def _call(self, func: Any, args: Any, kwargs: Any) -> Any:
        if self.timer is None:  # (the audit meter's steps: nothing to charge)
            return func(*args, **(kwargs or {}))
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self._op_s += time.perf_counter() - t0
        return out

    def _dispatch(self, func: Any, args: Any, kwargs: Any) -> Any:
        if func.namespace == "c10d":
            self._collective(func, args)
        if self.workspace and not self.paused:
            torch.cuda.reset_peak_memory_stats()
            out = self._call(func, args, kwargs)
            # what the op held while it ran and gave back (cuDNN's workspace, a kernel's scratch)
            held = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
            if held > 0:
                self._seq += 1
                at = self.calls()
                self._log.extend(((at, self._seq, held), (at, self._seq, -held)))
        else:
            out = self._call(func, args, kwargs)
        if self.paused or getattr(RUNTIME_ALLOCATING, "on", False):
            return out
        flat_out = tree_flatten(out)[0]
        if not any(isinstance(t, torch.Tensor) for t in flat_out):
            return out
        # an output on an input's storage is a view or an in-place result: no new bytes
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in flat_out:
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self._watch(t)
        return out

    def _collective(self, func: Any, args: Any) -> None:
        """A collective the step runs (R18), tallied by kind: how many, and their payload bytes."""
        kind = COLLECTIVES.get(func._opname)
        if kind is None or len(args) <= kind[1]:
            return
        payload = sum(t.numel() * t.element_size() for t in tree_flatten(args[kind[1]])[0] if isinstance(t, torch.Tensor))
        tally = self.collectives.setdefault(kind[0], [0, 0])
        tally[0] += 1
        tally[1] += payload

    def _watch(self, t: torch.Tensor) -> int | None:
        return self.watch(t.untyped_storage())

    def watch(self, st: Any) -> int | None:
        """Count storage ``st`` from now until it dies, unless it is counted already (the caller's
        batch, made before the step, where the step saves it); its sequence number, or None."""
        key, n = st._cdata, st.nbytes()
        if key in self._live or n == 0:
            return None
        self._seq += 1
        seq = self._seq
        self._live[key] = seq
        self._log.append((self.calls(), seq, n))
        self._finalizers.append(weakref.finalize(st, self._died, key, seq, n))
        return seq

    def _died(self, key: int, seq: int, n: int) -> None:
        if self._live.get(key) == seq:
            del self._live[key]
        self._log.append((self.calls(), seq, -n))

    def saved(self, t: torch.Tensor, tid: int) -> None:
        """``t`` was packed as trace tensor ``tid`` (order of first sight): if a storage made here,
        its bytes are the trace's while ``tid`` is kept (R2)."""
        seq = self._live.get(t.untyped_storage()._cdata)
        if seq is not None:
            self._saved.setdefault(tid, []).append(seq)

    def gradient(self, g: torch.Tensor, stolen: bool) -> None:
        """``g`` arrives for a parameter's gradient: where autograd takes it as the gradient
        (``stolen``: the parameter has none yet), its bytes are the state's (``static_bytes``, or
        R13's gradient of its group), whatever becomes of it after the step, or, with
        ``grads_born``, an other byte from its birth (noted in :attr:`births`); where it is added
        into an existing gradient, it is a transient like any other."""
        seq = self._live.get(g.untyped_storage()._cdata)
        if stolen and self.grads_born:
            self.births.append((self.calls(), g.untyped_storage().nbytes()))
        elif stolen and seq is not None:
            self._grads.add(seq)

    def hook_gradients(self, params: Iterable[torch.nn.Parameter], exits: contextlib.ExitStack) -> None:
        """Tell :meth:`gradient` of each gradient autograd gives ``params`` (those that require one),
        until ``exits`` closes."""
        for p in params:
            if p.requires_grad:
                exits.callback(p.register_hook(lambda g, p=p: self.gradient(g, p.grad is None)).remove)

    def shift(self, delta: int) -> None:
        """Bytes the meter cannot see as storages changed by ``delta`` now (a storage resized in
        place: the training state a mover fetches and lets go)."""
        self._seq += 1
        self._log.append((self.calls(), self._seq, delta))

    def peak(self) -> int:
        """The most bytes alive at once over the whole step, parameters' gradients left out."""
        return self._walk(0, set(self._grads))[0]

    def per_call(self, n_calls: int, saved: Iterable[int], static: Iterable[torch.Tensor]) -> list[int]:
        """The most bytes alive in the gap before each hook call ``0..n_calls`` (the last: the
        compute after the last hook call), leaving out the storages of trace tensors ``saved`` and
        those of ``static`` tensors (counted in ``static_bytes``: parameters' gradients made in
        backward)."""
        static_keys = {t.untyped_storage()._cdata for t in static}
        leave_out = {seq for key, seq in self._live.items() if key in static_keys} | self._grads
        leave_out |= {seq for tid in saved for seq in self._saved.get(tid, ())}
        return self._walk(n_calls, leave_out)

    def _walk(self, n_calls: int, leave_out: set[int]) -> list[int]:
        peaks = [0] * (n_calls + 1)
        alive = 0
        call = 0
        for at, seq, delta in list(self._log):
            if seq in leave_out:
                continue
            at = min(at, n_calls)
            while call < at:  # the level carries into the gaps where nothing was made or died
                call += 1
                peaks[call] = max(peaks[call], alive)
            alive += delta
            peaks[call] = max(peaks[call], alive)
        while call < n_calls:
            call += 1
            peaks[call] = max(peaks[call], alive)
        return peaks

    def close(self) -> None:
        """Stop watching: the storages still alive need no finalizer from this step."""
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self._live.clear()
