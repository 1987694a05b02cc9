"""The budget is real: the memory the runtime holds, measured from the storages themselves
(``SwapRuntime(audit=True)``), stays within the budget, and only what the runtime owns is evicted."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from swapsched.deploy import SwapRuntime
from swapsched.zoo import build_model


def _run(case, steps: int = 6, **kwargs) -> SwapRuntime:
    opt = torch.optim.SGD(case.model.parameters(), lr=0.01)
    rt = SwapRuntime(backend="cpu", bandwidth=4e9, model=case.model, audit=True, **kwargs)
    try:
        for _ in range(steps):
            with rt.step():
                case.loss().backward()
            opt.step()
            opt.zero_grad()
    finally:
        rt.close()
    return rt


def _assert_within(rep) -> None:
    assert rep.mode == "execute"
    assert rep.measured_peak_bytes is not None
    # the meter sees every storage in the step, transients included (R3); the trace counts them
    # per gap between saved tensors, so the budget holds to within what ordering inside a gap can
    # add: issue 44's 2% (resnet-tiny comes 0.01% over, a few hundred bytes)
    assert rep.measured_peak_bytes <= 1.02 * rep.budget_bytes, (rep.measured_peak_bytes, rep.budget_bytes)
    assert rep.peak_device_bytes <= rep.budget_bytes


@pytest.mark.parametrize("family", ["mlp", "resnet", "gpt", "unet"])
@pytest.mark.parametrize("policy", ["swap-all", "min", "capuchin", "default"])
@pytest.mark.parametrize("budget", ["80%", "90%"])  # mlp-tiny's backward holds 78% of its peak beyond what moves (R3)
def test_measured_peak_within_budget(family, policy, budget):
    rt = _run(build_model(family, "tiny", seed=1), budget=budget, policy=policy)
    _assert_within(rt.report())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mlp", "vgg", "resnet", "gpt", "bert", "unet"])
@pytest.mark.parametrize("policy", ["swap-all", "vdnn-all", "vdnn-conv", "min", "capuchin", "default"])
@pytest.mark.parametrize("budget", ["30%", "50%", "70%", "90%"])
def test_measured_peak_within_budget_whole_zoo(family, policy, budget):
    from swapsched.budget import BudgetError

    try:
        rt = _run(build_model(family, "tiny", seed=1), budget=budget, policy=policy)
    except BudgetError as exc:  # below the smallest feasible budget: said so, never run over it
        assert "smallest feasible budget" in str(exc)
        return
    _assert_within(rt.report())


def test_swap_in_buffers_are_freed_at_their_last_use():
    """After backward nothing saved is held: the swap-in buffers went with their last unpack (they
    used to live until the step ended, held by the swap-in ticket)."""
    case = build_model("gpt", "tiny", seed=2)
    rt = SwapRuntime(budget="90%", policy="swap-all", backend="cpu", model=case.model)
    for _ in range(5):
        with rt.step():
            case.loss().backward()
            ex = rt._exec
            if rt.report().mode == "execute" if rt._report else False:
                ex._drain()
                assert ex.used == 0  # the accounting is storage liveness: every swap-in buffer died
    assert rt.report().mode == "execute" and rt.report().prefetched_bytes + rt.report().on_demand_bytes > 0
    rt.close()


def test_the_callers_batch_and_module_buffers_are_not_evicted():
    case = build_model("resnet", "tiny", seed=3)  # BatchNorm: its running stats are saved too
    rt = _run(case, budget="90%", policy="swap-all")
    x = case.inputs[0]
    rep = rt.report()
    # the batch (and the labels the loss saves) stay resident, counted once in the static bytes;
    # the BatchNorm buffers are already in them (static_bytes_of the model)
    assert rep.unowned_bytes >= x.untyped_storage().nbytes()
    # ... less the weights' gradients, which count from their birth in backward (R3)
    born = int(rt.trace.gradients_born_so_far[-1])
    assert born == sum(p.numel() * 4 for p in case.model.parameters() if p.requires_grad)
    assert rt.trace.static_bytes == rt.static_bytes + rep.unowned_bytes - born
    assert all(t.bytes != x.untyped_storage().nbytes() or t.op != "" for t in rt.trace.tensors)
    assert rep.evicted_bytes == sum(t.bytes for t in rt.trace.tensors)  # swap-all evicts only what it owns


class _Autocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.b(torch.relu(self.a(x))).float()


def test_autocast_casts_of_weights_are_made_again_and_gradients_match():
    torch.manual_seed(0)
    a, b = _Autocast(), _Autocast()
    b.load_state_dict(a.state_dict())
    x = torch.randn(16, 32)
    rt = SwapRuntime(budget="100%", policy="swap-all", backend="cpu", model=a, audit=True)
    for _ in range(6):
        with rt.step():
            a(x).sum().backward()
        b(x).sum().backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=False))
        a.zero_grad(), b.zero_grad()
    rep = rt.report()
    # the bf16 copy of b's weight (saved for the input's gradient; a's is not saved, its input
    # needs none) is made again at its unpack (R12): not in the trace, and not static either
    # (a's weight gradient reads the batch's bf16 cast, an activation of the trace)
    assert all(t.dtype != "bfloat16" or t.shape not in ((8, 64), (64, 8)) for t in rt.trace.tensors)
    assert rt.trace.meta["recasts"] == 1
    assert rep.unowned_bytes == 0
    _assert_within(rep)
    rt.close()


class _Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.complex64))

    def forward(self, x):
        h = x @ self.w
        c = h.conj()  # a lazy conj view: saved by the mul with its conj bit
        n = torch._neg_view(h)  # and a lazy negation
        return (c * c + n * n * c).real.sum()


def test_complex_conj_and_neg_views_keep_their_bits_when_evicted():
    torch.manual_seed(0)
    a, b = _Complex(), _Complex()
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 8, dtype=torch.complex64)
    rt = SwapRuntime(budget="100%", policy="swap-all", backend="cpu", model=a, min_bytes=0)
    for _ in range(5):
        with rt.step():
            la = a(x)
            la.backward()
        lb = b(x)
        lb.backward()
        assert torch.equal(la, lb) and torch.equal(a.w.grad, b.w.grad)
        a.zero_grad(), b.zero_grad()
    assert rt.report().mode == "execute" and rt.report().evicted_bytes > 0
    rt.close()


@pytest.mark.parametrize("warm_steps", [0, 5])  # a profiling step, an executed one
def test_a_dropped_graph_frees_its_saved_tensors_without_the_cyclic_gc(warm_steps):
    """A pack that kept the tensor itself (not a detached alias) tied it to its own grad_fn in a
    cycle: a graph dropped without backward then held its activations until a gc pass. (Tensors
    under ``min_bytes`` were packed that way.)"""
    case = build_model("mlp", "tiny", seed=4)
    rt = SwapRuntime(budget="100%", policy="no-swap", backend="cpu", model=case.model, min_bytes=10**9)
    for _ in range(warm_steps):
        with rt.step():
            case.loss().backward()
    gc.disable()
    try:
        refs = []
        with rt.step():
            h = case.model.net[0](case.inputs[0])
            out = case.model.net[1](h)  # GELU saves h
            refs.append(weakref.ref(h.untyped_storage()))
            del h, out  # the graph goes without a backward pass
        assert refs[0]() is None
    finally:
        gc.enable()
        rt.close()


def test_zoo_inputs_are_drawn_on_the_cpu_generator_inside_a_device_context():
    """Inside ``torch.device("cuda")`` a factory call with a CPU generator and no device draws on
    CUDA, which rejects the generator: every GPU test crashed at its first input. The zoo draws on
    the CPU explicitly (checked here under ``meta``, the same context mechanism)."""
    seen = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if kwargs.get("generator") is not None:
                seen.append(str(kwargs.get("device")))
            return func(*args, **kwargs)

    for family in ("mlp", "resnet", "gpt", "unet"):
        with Watch():
            case = build_model(family, "tiny", device="meta")
        assert all(t.device.type == "meta" for t in case.inputs)
    assert seen and set(seen) == {"cpu"}


def _paired_steps(a, b, rt, step_a, step_b, steps=6):
    for _ in range(steps):
        with rt.step():
            step_a()
        step_b()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=False))
        a.zero_grad(), b.zero_grad()


def test_activation_checkpointing_on_some_blocks_composes_within_budget():
    from torch.utils.checkpoint import checkpoint

    a = build_model("gpt", "tiny", seed=6)
    b = build_model("gpt", "tiny", seed=6)
    blocks = [m for m in a.model.modules() if type(m).__name__ == "TransformerBlock"]
    fwd = blocks[0].forward
    blocks[0].forward = lambda *x, _f=fwd: checkpoint(_f, *x, use_reentrant=False)  # the first block recomputes
    rt = SwapRuntime(budget="90%", policy="min", backend="cpu", model=a.model, audit=True)
    _paired_steps(a.model, b.model, rt, lambda: a.loss().backward(), lambda: b.loss().backward())
    _assert_within(rt.report())
    rt.close()


def test_gradient_accumulation_in_one_step_composes_within_budget():
    a = build_model("mlp", "small", seed=7)
    b = build_model("mlp", "small", seed=7)

    def two_micro_batches(case):
        for _ in range(2):  # several forward/backward passes per optimizer step
            case.loss().backward()

    rt = SwapRuntime(budget="80%", policy="capuchin", backend="cpu", model=a.model, audit=True)
    _paired_steps(a.model, b.model, rt, lambda: two_micro_batches(a), lambda: two_micro_batches(b))
    _assert_within(rt.report())
    rt.close()


def test_a_batchnorm_convnet_is_measured_within_budget_its_running_stats_counted_once():
    # a MobileNet-style net whose BatchNorms save their running stats for backward: the audit
    # meter counted those buffers again on top of the static bytes (8040 B over a 21.9 MB
    # budget on every executed step), though the runtime held them once
    class Depthwise(nn.Module):
        def __init__(self, width: int = 64, depth: int = 8) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, width, 3, stride=2, padding=1)
            self.blocks = nn.ModuleList([nn.Sequential(
                nn.Conv2d(width, width, 3, padding=1, groups=width), nn.BatchNorm2d(width), nn.ReLU6(),
                nn.Conv2d(width, width, 1), nn.BatchNorm2d(width), nn.ReLU6()) for _ in range(depth)])
            self.head = nn.Linear(width, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.stem(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x.mean(dim=(2, 3)))

    torch.manual_seed(0)
    model = Depthwise()
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    case = type("Case", (), {"model": model, "loss": lambda self: nn.functional.cross_entropy(model(x), y)})()
    for policy in ("min", "capuchin"):
        rt = SwapRuntime(backend="cpu", bandwidth=4e9, model=model, audit=True, budget="80%", policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        try:
            for _ in range(5):
                with rt.step():
                    case.loss().backward()
                opt.step()
                opt.zero_grad()
                rep = rt.report()
                if rep.mode == "execute":
                    assert rep.measured_peak_bytes is not None and rep.measured_peak_bytes <= rep.budget_bytes, policy
        finally:
            rt.close()
        assert rep.mode == "execute"


class _Wide(nn.Module):
    """Gradients about half the activations' bytes (batch 256): both shape backward's peak."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(6)))

    def forward(self, x):
        return self.layers(x).square().mean()


@pytest.mark.parametrize("accumulate", [1, 2], ids=["each-step", "accumulating"])
def test_gradients_counted_from_their_birth_keep_the_budget_under_both_meters(accumulate):
    """R3: a run whose state cannot move (a relative budget) counts each gradient from its birth:
    the trace's static bytes are the parameters alone, its last gap holds every gradient, and the
    executed steps keep the budget under the audit meter. A run whose steps begin with the
    gradients of the step before (accumulating over two) profiles again from its first such step
    and counts them as static: its forward holds them."""
    a, b = _Wide(), _Wide()
    x = torch.randn(256, 256)
    params = sum(p.numel() * 4 for p in a.parameters())
    rt = SwapRuntime(budget="90%", policy="min", backend="cpu", model=a, audit=True)
    reports = []
    for step in range(9):
        with rt.step():
            a(x).backward()
        b(x).backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True))
        reports.append(rt.report())
        if (step + 1) % accumulate == 0:
            a.zero_grad(set_to_none=True), b.zero_grad(set_to_none=True)
    trace = rt.trace
    if accumulate == 1:
        born = sum(nbytes for _, nbytes in trace.meta["gradients_born"])
        assert trace.static_bytes == params + trace.meta["unowned_bytes"]
        assert born == params and trace.events[-1].other_bytes >= born
    else:
        assert trace.static_bytes == 2 * params + trace.meta["unowned_bytes"] and "gradients_born" not in trace.meta
    executed = [r for r in reports if r.mode == "execute"]
    assert len(executed) >= 4
    for rep in executed:
        _assert_within(rep)
    rt.close()
