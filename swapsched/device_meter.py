"""The peak device memory of one training step, measured the same way whatever the method
(``swapsched run --compare``'s meter, ``scripts/bench_budget_audit.py``'s device meter)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from swapsched.runtime.shards import local_of, offloaded_by_fsdp

__all__ = ["DeviceMeter"]


class DeviceMeter:
    """Peak device bytes of one training step, whatever the method: on CUDA torch's
    ``max_memory_allocated``; on the CPU the bytes of every storage an op makes on the main thread
    while it lives (a ``TorchDispatchMode`` with a finalizer per storage), leaving out the runtime's
    own allocations (``transients.RUNTIME_ALLOCATING``: the host pool's buffers, since on the emulated
    device host and device are both the CPU), plus what was live before the step: parameters, buffers, gradients, optimizer state.
    Copies made on other threads (the emulated copy engines) write into buffers made here."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, device: str):
        self.model, self.optimizer, self.cuda = model, optimizer, device.startswith("cuda")
        self.peak = 0

    def _resident(self) -> int:
        seen: dict[int, int] = {}
        host = offloaded_by_fsdp(self.model)  # FSDP2's on the host (R18): not the device's
        params = [p for p in self.model.parameters() if id(p) not in host]
        tensors = [*params, *self.model.buffers()]
        tensors += [p.grad for p in params if p.grad is not None]
        if self.optimizer is not None:
            tensors += [v for p, st in self.optimizer.state.items() if id(p) not in host for v in st.values()
                        if isinstance(v, torch.Tensor)]
        for t in tensors:
            st = local_of(t).untyped_storage()  # a shard's own bytes, not its wrapper's
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    @contextlib.contextmanager
    def step(self) -> Any:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            yield
            torch.cuda.synchronize()
            self.peak = int(torch.cuda.max_memory_allocated())
            return
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        from swapsched.runtime.transients import RUNTIME_ALLOCATING

        base = self._resident()
        state = {"live": 0, "peak": 0}
        seen: set[int] = set()

        def died(key: int, nbytes: int) -> None:
            seen.discard(key)
            state["live"] -= nbytes

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                if getattr(RUNTIME_ALLOCATING, "on", False):
                    return out
                # an output on an input's storage is a view or an in-place result: no new bytes
                # (a weight's transpose is the weight's storage, made before the step)
                inputs = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                        st = t.untyped_storage()
                        key = st.data_ptr()
                        if key in seen or key in inputs or st.nbytes() == 0:
                            continue
                        seen.add(key)
                        state["live"] += st.nbytes()
                        state["peak"] = max(state["peak"], state["live"])
                        weakref.finalize(st, died, key, st.nbytes())
                return out

        with Mode():
            yield
        self.peak = base + state["peak"]
