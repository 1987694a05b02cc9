"""swapsched/runtime/casts.py: a parameter's compute copy under autocast, held only while used (R12)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from swapsched.deploy import SwapRuntime
from swapsched.precision import Precision
from swapsched.runtime.casts import Recast, no_autocast_cache, parameter_cast
from swapsched.runtime.profiler import profile

WIDTH, DEPTH = 256, 6
CAST = WIDTH * WIDTH * 2  # one weight's bf16 copy


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(DEPTH)))


def test_a_cast_of_a_parameter_and_its_views_are_told_from_other_casts():
    w = nn.Parameter(torch.randn(4, 3))
    cast = w.to(torch.bfloat16)
    assert parameter_cast(cast) == (w, cast)
    found = parameter_cast(cast.t())
    assert found is not None and found[0] is w and found[1] is cast
    assert parameter_cast(w) is None  # the parameter itself stays a parameter
    assert parameter_cast((w * 2).to(torch.bfloat16)) is None  # a cast of an activation is an activation
    assert parameter_cast(torch.randn(3).to(torch.bfloat16)) is None


def test_a_recast_remakes_the_same_bytes_and_view_and_refuses_a_changed_parameter():
    w = nn.Parameter(torch.randn(5, 7))
    view = w.to(torch.bfloat16).t()[1:]
    r = Recast.of(view)
    assert r is not None
    again = r.make()
    assert torch.equal(again, view) and again.stride() == view.stride() and again.dtype == torch.bfloat16
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="changed in place before backward"):
        r.make()


def test_autocast_regions_inside_inherit_the_cache_off_and_it_comes_back_after():
    assert torch.is_autocast_cache_enabled()
    with no_autocast_cache(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.is_autocast_cache_enabled()
    assert torch.is_autocast_cache_enabled()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_profiled_step_holds_a_weights_cast_only_while_it_is_used(device):
    """Five of the six weights' casts are saved (the first layer's input needs no gradient). Held
    from forward to backward, as autograd holds them without the recast, backward's first gap
    would hold all five beside the rest; made again at each unpack, backward holds the one it
    computes with and the bf16 gradient it makes, a little over two."""
    model = _mlp().to(device)
    x = torch.randn(8, WIDTH, device=device)
    trace = profile(model, (x,), device=device, precision=Precision("bf16", amp=True), state="adamw")
    assert max(e.other_bytes for e in trace.events) < 3 * CAST
    assert all(t.dtype != "bfloat16" or t.shape != (WIDTH, WIDTH) for t in trace.tensors)  # no cast is a trace tensor
    params = sum(p.numel() for p in model.parameters())
    assert trace.static_bytes == 16 * params  # fp32 weights, gradients, AdamW's two moments: no cast among them


@pytest.mark.parametrize("budget", ["100%", 1_600_000], ids=["activations", "state-moving"])
def test_live_steps_under_autocast_are_bit_identical_and_hold_no_cast_to_backward(budget):
    x = torch.randn(8, WIDTH)
    losses, params = [], []
    for use in (False, True):
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters())
        rt = SwapRuntime(budget=budget, policy="default", model=model, optimizer=opt, backend="cpu", audit=True) if use else None
        run = []
        for _ in range(6):
            with (rt.step() if rt is not None else torch.enable_grad()):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = model(x)
                loss = y.float().square().mean()
                loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses.append(run)
        params.append([p.detach().clone() for p in model.parameters()])
        if rt is not None:
            rep = rt.report()
            assert rep.mode == "execute"
            assert rt.trace.meta["recasts"] == DEPTH - 1
            # beside the weights' gradients, each counted from its birth in backward (R3)
            assert (rt.trace.other_bytes - rt.trace.gradients_born_so_far).max() < 3 * CAST
            # the audit meter sees the recasts as the step's own storages; the step holds its budget
            assert rep.measured_peak_bytes <= 1.02 * rep.budget_bytes and rep.peak_device_bytes <= rep.budget_bytes
            if isinstance(budget, int):
                assert rt.plan.state, "a byte budget below the static bytes moves the state"
            rt.close()
    assert losses[0] == losses[1]
    assert all(torch.equal(a, b) for a, b in zip(params[0], params[1], strict=True))
