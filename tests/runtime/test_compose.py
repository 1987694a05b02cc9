"""The runtime beside what users already run: evaluation between steps, train/eval switches,
torch.compile, and the saved-tensor cases of PyTorch's and torchtune's own offloading tests.
Each against the same run without swapsched: bit-identical losses and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from swapsched.budget import BudgetError
from swapsched.deploy import SwapRuntime
from swapsched.zoo import build_model
from tests.conftest import train_together


def test_evaluation_under_no_grad_between_steps_changes_nothing():
    a, b = build_model("gpt", "tiny", seed=2), build_model("gpt", "tiny", seed=2)
    x = a.inputs

    def run(model, i):
        loss = a.loss_fn(model(*x))
        loss.backward()
        with torch.no_grad():  # an evaluation pass inside the step: saves nothing, changes nothing
            model(*x)
        return loss

    rt = SwapRuntime(budget="50%", policy="min", backend="cpu", min_bytes=0, model=a.model, tune=False)
    try:
        assert [r.mode for r in train_together(a.model, b.model, rt, 7, run)] == ["profile"] * 3 + ["execute"] * 4
        assert rt.report().evicted_bytes > 0
    finally:
        rt.close()


def test_a_step_in_eval_mode_diverges_finishes_on_demand_and_says_where():
    """BatchNorm and Dropout save other tensors in eval mode: the step leaves the trace, finishes
    on demand with identical gradients, the report says where, and the runtime profiles again."""
    a, b = build_model("resnet", "tiny", seed=3), build_model("resnet", "tiny", seed=3)
    x = a.inputs

    def run(model, i):
        model.train(i != 4)  # step 4 (an executed one) in eval mode
        loss = a.loss_fn(model(*x))
        loss.backward()
        return loss

    rt = SwapRuntime(budget="60%", policy="min", backend="cpu", min_bytes=0, model=a.model, profile_steps=1, tune=False)
    try:
        reports = train_together(a.model, b.model, rt, 8, run)
        assert [r.mode for r in reports][3:] == ["execute", "diverged", "profile", "execute", "execute"]
        where = reports[4].divergence
        assert where is not None and where.expected != where.seen and not reports[4].plan_followed
    finally:
        rt.close()


def _compiled_each(case) -> None:
    net = case.model.net
    for i, layer in enumerate(net):
        net[i] = torch.compile(layer)


@pytest.mark.slow
def test_torch_compile_per_block_swaps_between_blocks_with_identical_gradients():
    a, b = build_model("mlp", "small", seed=1), build_model("mlp", "small", seed=1)
    _compiled_each(a)
    _compiled_each(b)
    x = a.inputs

    def run(model, i):
        loss = model(*x).sum()
        loss.backward()
        return loss

    rt = SwapRuntime(budget="70%", policy="swap-all", backend="cpu", min_bytes=0, model=a.model)
    try:
        assert train_together(a.model, b.model, rt, 6, run)[-1].mode == "execute"
        assert rt.report().evicted_bytes > 0
    finally:
        rt.close()


@pytest.mark.slow
def test_torch_compile_of_the_whole_model_is_refused_below_its_floor_with_what_to_do():
    a = build_model("mlp", "small", seed=1)
    model = torch.compile(a.model)
    rt = SwapRuntime(budget="50%", policy="min", backend="cpu", min_bytes=0, model=a.model, tune=False)
    try:
        with pytest.raises(BudgetError, match="compile its blocks separately"):
            for _ in range(4):
                with rt.step():
                    model(*a.inputs).sum().backward()
    finally:
        rt.close()


class _SaveInAndOut(torch.autograd.Function):
    """A custom Function saving its input and its output (PyTorch's saved-tensor-hook tests)."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * y + 0 * x


class _ViewGrad(torch.autograd.Function):
    """torchtune's case: a backward whose gradient is a view of a tensor it unpacked."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * w.sum()

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g * w.sum(), w.view(-1).view(w.shape)


class PeersCases(nn.Module):
    """Saved outputs, a custom Function saving input and output, views of views, a view-returning
    backward, and one storage saved under two shapes."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.b = nn.Linear(64, 64)
        self.w = nn.Parameter(torch.randn(32, 64))

    def forward(self, x):
        h = self.a(x).tanh()  # tanh saves its output
        v = h.view(-1, 2, 64)[:, 1]  # a view of a view
        u = _SaveInAndOut.apply(v * 0.1)
        z = _ViewGrad.apply(self.b(u), self.w[:, :64] * 1.0)
        return (z.sigmoid() * h[:, :64]).sum()


@pytest.mark.parametrize("policy", ["swap-all"])  # its peak is where nothing saved can move (R3): no budget-aware plan evicts
def test_the_saved_tensor_cases_peers_test_their_offloading_with(policy):
    torch.manual_seed(0)
    a, b = PeersCases(), PeersCases()
    b.load_state_dict(a.state_dict())
    x = torch.randn(32, 64)

    def run(model, i):
        loss = model(x)
        loss.backward()
        return loss

    rt = SwapRuntime(budget="100%", policy=policy, backend="cpu", min_bytes=0, model=a)
    try:
        assert train_together(a, b, rt, 6, run)[-1].mode == "execute"
        assert rt.report().evicted_bytes > 0
    finally:
        rt.close()


def test_a_step_with_no_backward_diverges_at_its_end_and_training_goes_on_identically():
    a, b = build_model("mlp", "small", seed=5), build_model("mlp", "small", seed=5)
    x = a.inputs

    def run(model, i):
        loss = a.loss_fn(model(*x))
        if i != 4:  # step 4: forward only (a validation step written inside the runtime's step)
            loss.backward()
        return loss

    rt = SwapRuntime(budget="70%", policy="min", backend="cpu", min_bytes=0, model=a.model, profile_steps=1,
                     tune=False)
    try:
        for m in (a.model, b.model):  # step 4 leaves no gradient to compare: start with zeros
            for p in m.parameters():
                p.grad = torch.zeros_like(p)
        reports = []
        for i in range(8):
            with rt.step():
                la = run(a.model, i)
            lb = run(b.model, i)
            assert torch.equal(la, lb) and all(torch.equal(p.grad, q.grad) for p, q in
                                               zip(a.model.parameters(), b.model.parameters(), strict=True))
            reports.append(rt.report())
        assert [r.mode for r in reports][3:5] == ["execute", "diverged"] and reports[-1].mode == "execute"
        where = reports[4].divergence
        assert where.seen.startswith("the end of the step after") and where.expected.startswith("unpack of tensor")
    finally:
        rt.close()
