"""runtime/recompute.py and R9 in the runtime: blocks recomputed live under torch.utils.checkpoint,
with bit-identical gradients (dropout included), the budget held by the audit meter, and the
swaps of what stays planned on the steps as they then run."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from swapsched.agents.recompute import CheckpointAll
from swapsched.deploy import SwapRuntime
from swapsched.errors import UserError, present
from swapsched.plan import Eviction, SwapPlan
from tests.conftest import train_together


class Blocks(nn.Module):
    """An input layer, three residual blocks of several layers each (with dropout), a head."""

    def __init__(self, d: int = 64, n: int = 3, p: float = 0.2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(p),
                                                  nn.Linear(4 * d, d)) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = h + b(h)
        return self.head(h).pow(2).mean()


X = torch.randn(32, 64, generator=torch.Generator().manual_seed(7))


def _step(model: nn.Module, i: int) -> torch.Tensor:
    torch.manual_seed(1000 + i)  # the same dropout masks for both copies
    loss = model(X)
    loss.backward()
    return loss


#: a batch whose activations outweigh the weights' gradients, which a relative budget counts
#: static and the step holds only from their birth in backward (R3)
X_WIDE = torch.randn(256, 64, generator=torch.Generator().manual_seed(7))


def _wide_step(model: nn.Module, i: int) -> torch.Tensor:
    torch.manual_seed(1000 + i)
    loss = model(X_WIDE)
    loss.backward()
    return loss


def _calls(module: nn.Module) -> list[int]:
    """Forward calls of ``module`` in each step so far (a recompute calls it again)."""
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(-1, calls[-1] + 1))
    return calls


def test_checkpointed_blocks_train_bit_identically_with_dropout_and_hold_the_budget():
    a, b = Blocks(), Blocks()
    calls = _calls(a.blocks[0][1])
    rt = SwapRuntime(budget="70%", policy=CheckpointAll(), backend="cpu", model=a, audit=True, profile_steps=2)
    try:
        reports = []
        for i in range(7):
            calls.append(0)
            reports += train_together(a, b, rt, 1, lambda m, _i=i: _step(m, _i))
        # 2 profiling steps as written, 2 more once the blocks are checkpointed, then the plan
        assert [r.mode for r in reports] == ["profile"] * 4 + ["execute"] * 3
        assert [len(r.recomputed_blocks) for r in reports] == [0, 0, 3, 3, 3, 3, 3]
        assert calls[1:][-3:] == [2, 2, 2]  # forward, then the recompute in backward
        assert calls[1:3] == [1, 1]
        last = reports[-1]
        assert last.recomputed_blocks == ("blocks.0", "blocks.1", "blocks.2")
        assert last.plan_followed and last.guard_evictions == 0
        assert last.measured_peak_bytes <= last.peak_device_bytes <= last.budget_bytes
    finally:
        rt.close()
    assert all("forward" not in blk.__dict__ for blk in a.blocks)  # close() takes the wrappers off


def test_the_steps_are_profiled_again_with_what_each_recompute_holds_after_its_inputs_unpack():
    a = Blocks()
    rt = SwapRuntime(budget="70%", policy=CheckpointAll(), backend="cpu", model=a, profile_steps=1, retime_steps=0)
    try:
        for i in range(3):
            with rt.step():
                _step(a, i)
        plain, wrapped = rt._unwrapped_trace, rt.trace
        assert [sg.name for sg in plain.segments] == ["blocks.0", "blocks.1", "blocks.2"]
        assert wrapped.n_events < plain.n_events and wrapped.n_tensors < plain.n_tensors
        # a gap per block holds its recompute, at least the members' bytes, in backward, where
        # the step holds most beyond its saved tensors (R3)
        other = wrapped.other_bytes
        members = {sg.bytes for sg in plain.segments}
        backward = sorted(other[wrapped.backward_start:], reverse=True)
        assert all(n >= min(members) for n in backward[:3])
        assert int(other.argmax()) >= wrapped.backward_start
        assert wrapped.min_feasible_bytes <= rt.budget_bytes
    finally:
        rt.close()


def test_a_recompute_whose_steps_overrun_the_budget_falls_back_to_swaps():
    """R9's second stage with R3: a budget the steps meet as they run, and the steps with every
    block checkpointed do not (the recompute holds what it rebuilds beside backward's gradients).
    The runtime warns, puts the blocks' own forward back, and trains within the budget on swaps."""
    a = Blocks(seed=2)
    with SwapRuntime(budget="100%", policy=CheckpointAll(), backend="cpu", model=a, profile_steps=1,
                     retime_steps=0) as probe:
        for i in range(3):
            with probe.step():
                _step(a, i)
        plain, wrapped = probe._unwrapped_trace, probe.trace
    budget = plain.min_feasible_bytes  # what the steps can meet as they run, 9% below the checkpointed steps here
    assert budget < wrapped.min_feasible_bytes
    a, b = Blocks(seed=2), Blocks(seed=2)
    rt = SwapRuntime(budget=budget, policy=CheckpointAll(), backend="cpu", model=a, profile_steps=1, retime_steps=0)
    try:
        with pytest.warns(RuntimeWarning, match="swapping instead"):
            reports = train_together(a, b, rt, 5, _step)
        assert [r.mode for r in reports[:2]] == ["profile", "profile"]
        assert reports[-1].mode == "execute" and reports[-1].recomputed_blocks == ()
        assert all(r.peak_device_bytes <= budget for r in reports[2:])
        assert all("forward" not in blk.__dict__ for blk in a.blocks)
    finally:
        rt.close()


def test_the_joint_planner_recomputes_where_the_link_is_slow_and_swaps_where_it_is_fast():
    for bandwidth, recomputes in ((1e6, True), (1e10, False)):
        a, b = Blocks(seed=1), Blocks(seed=1)
        rt = SwapRuntime(budget="50%", policy="default", backend="cpu", bandwidth=bandwidth, model=a, profile_steps=2)
        try:
            reports = train_together(a, b, rt, 7, _wide_step)
            # within the budget; the plan is followed on a quiet machine, but under load (CI) the
            # guard has been seen to step in once, so that is not asserted here
            last = reports[-1]
            assert last.mode == "execute" and last.peak_device_bytes <= last.budget_bytes
            assert bool(last.recomputed_blocks) == recomputes, bandwidth
        finally:
            rt.close()


@pytest.mark.parametrize("how", ["recompute", "selective"])
def test_use_plan_recomputes_the_given_blocks_and_swaps_what_they_still_save(how):
    # R9's two stages for a plan given whole: blocks.1 is checkpointed, the steps are profiled
    # again, and the plan's eviction of the input's copy (outside every block) is carried onto
    # what the steps then save; training stays bit-identical
    a, b = Blocks(seed=2), Blocks(seed=2)
    rt = SwapRuntime(budget="100%", policy="min", backend="cpu", model=a, profile_steps=1, retime_steps=0)
    try:
        train_together(a, b, rt, 1, _step)
        first = int(rt.trace.events[0].tensor)
        rt.use_plan(SwapPlan.of(rt.trace, "hand", [Eviction(first, 0, int(rt.trace.first_unpack[first]))], **{how: ["blocks.1"]}))
        reports = train_together(a, b, rt, 3, lambda m, i: _step(m, i + 1))
        assert [r.mode for r in reports] == ["profile", "execute", "execute"]
        assert reports[-1].recomputed_blocks == ("blocks.1",) and reports[-1].plan_followed
        assert reports[-1].selective_blocks == (("blocks.1",) if how == "selective" else ())
        assert len(rt.plan.evictions) == 1 and reports[-1].evicted_bytes == rt.trace.tensors[rt.plan.evictions[0].tensor].bytes
        # a swap plan after it runs on the steps with no block checkpointed again
        rt.use_plan(SwapPlan.of(rt._unwrapped_trace, "hand", []))
        reports = train_together(a, b, rt, 1, lambda m, i: _step(m, i + 4))
        assert reports[-1].mode == "execute" and reports[-1].recomputed_blocks == ()
    finally:
        rt.close()


def test_a_given_plan_whose_blocks_overrun_once_profiled_says_which_blocks():
    # recomputing a whole block holds all its members at once, where swapping them needs one at
    # a time: at the step's floor with no block checkpointed, checkpointing all three overruns.
    # With no policy to fall back on, the refusal names the plan's blocks (it used to speak only
    # of the step's smallest budget, as if the user's budget were wrong for the model)
    from swapsched.budget import BudgetError

    a, b = Blocks(seed=2), Blocks(seed=2)
    rt = SwapRuntime(budget="100%", policy=None, backend="cpu", model=a, profile_steps=1, retime_steps=0)
    try:
        train_together(a, b, rt, 1, _step)
        t = rt.trace
        rt.use_plan(SwapPlan.of(t, "hand", [], recompute=[s.name for s in t.segments]), budget=int(t.min_feasible_bytes))
        with pytest.raises(BudgetError, match=r"the plan given to use_plan recomputes blocks\.0, blocks\.1, blocks\.2.*"
                                              r"recomputes other blocks, or a larger budget"):
            train_together(a, b, rt, 2, lambda m, i: _step(m, i + 1))
    finally:
        rt.close()


def _profiled(family: str, budget: int | str, bandwidth: float = 1e9) -> tuple[object, SwapRuntime]:
    """A zoo model (tiny) and a runtime that has profiled three of its steps under ``budget``."""
    from swapsched.zoo import build_model

    case = build_model(family, "tiny", seed=1)
    rt = SwapRuntime(budget=budget, policy=None, backend="cpu", bandwidth=bandwidth, model=case.model, audit=True)
    for _ in range(3):
        with rt.step():
            case.loss_fn(case.model(*case.inputs)).backward()
        case.model.zero_grad(set_to_none=True)
    return case, rt


def _executed(case, rt: SwapRuntime, plan: SwapPlan, budget: int | None = None):
    """The report of the last of five steps run on ``plan`` (given through use_plan, with ``budget``)."""
    rt.use_plan(plan, budget=budget)
    for _ in range(5):
        with rt.step():
            case.loss_fn(case.model(*case.inputs)).backward()
        case.model.zero_grad(set_to_none=True)
    return rt.report()


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_checkpointing_every_block_is_predicted_to_hold_what_the_audit_meter_measures(family):
    # R9 with R3: the simulator counts what a recompute holds beside its members as the gaps'
    # other bytes it spans (the lesser of the two at its boundary) and its forward's peak with
    # the members made by then. Counted as the gap's own and the forward's spread (before), both
    # models were predicted 4-10% over what their executed steps hold.
    from swapsched.env.simulator import simulate

    case, rt = _profiled(family, "100%")
    try:
        plan = CheckpointAll().plan(rt.trace, rt.trace.peak_bytes_no_swap, rt.hardware)
        predicted = simulate(rt.trace, plan, rt.hardware, 10**12, validate=False).peak_bytes
        budget = int(predicted * 1.005)  # a byte budget just above it
        rep = _executed(case, rt, plan, budget)
        assert rep.mode == "execute" and rep.recomputed_blocks and rep.plan_followed and rep.guard_evictions == 0
        assert rep.measured_peak_bytes is not None and abs(rep.measured_peak_bytes - predicted) <= 0.002 * predicted
        assert rep.peak_device_bytes <= budget
    finally:
        rt.close()


def test_a_hybrid_plan_the_simulator_lets_fit_runs_as_planned_within_its_budget():
    # the kind of plan that had the count above reverted (session 23): gpt tiny at 50%, its first
    # block recomputed and MIN's swaps of the other tensors beside it, given through use_plan
    # (made by hand: which blocks Capuchin recomputes there depends on the measured gaps)
    from swapsched.agents.registry import get_policy
    from swapsched.env.simulator import simulate

    case, rt = _profiled("gpt", "50%", bandwidth=1e8)
    try:
        trace, budget = present(rt.trace, "the trace"), present(rt.budget_bytes, "the budget")
        block = trace.segments[0]
        swaps = [e for e in get_policy("min").plan(trace, budget, rt.hardware).evictions
                 if e.tensor not in block.members and e.tensor != block.anchor]
        plan = SwapPlan.of(trace, "hybrid", swaps, recompute=(block.name,))
        assert swaps and not simulate(trace, plan, rt.hardware, budget, validate=False).oom
        rep = _executed(case, rt, plan)
        assert rep.mode == "execute" and rep.recomputed_blocks == (block.name,) and rep.guard_evictions == 0
        assert rep.peak_device_bytes <= rep.budget_bytes and rep.measured_peak_bytes <= rep.budget_bytes
    finally:
        rt.close()


def test_runs_of_single_layers_are_planned_offline_but_not_recomputed_live():
    # a Sequential of single layers: its blocks are runs (checkpoint_sequential's cut), not one module each
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())])
    x = torch.randn(8, 32)
    rt = SwapRuntime(budget="85%", policy=CheckpointAll(), backend="cpu", model=model, profile_steps=1)
    try:
        with rt.step():
            model(x).sum().backward()
        assert rt._unwrapped_trace.segments and all("-" in sg.name for sg in rt._unwrapped_trace.segments)
        assert rt._planned_on(rt.trace).segments == () and rt.report().recomputed_blocks == ()
    finally:
        rt.close()


class _Count(TorchDispatchMode):
    """Counts the calls of one op that really run (below the checkpoint's cache, which answers
    a saved op without running it)."""

    def __init__(self, op):
        super().__init__()
        self.op, self.n = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is self.op
        return func(*args, **(kwargs or {}))


# what each selective Blocks block keeps (batch 32, d 64, float32): the layer norm's call
# (output 32x64, mean and rstd 32x1 each), the first linear's output (32x256, saved by gelu) and
# dropout's output (32x256, saved by the second linear); gelu and dropout's mask are recomputed
KEPT_PER_BLOCK = 4 * (32 * 64 + 2 * 32 + 32 * 256 + 32 * 256)


def test_the_runtime_profile_names_each_saved_tensors_op():
    a = Blocks(seed=3)
    rt = SwapRuntime(budget="100%", policy="min", backend="cpu", model=a, profile_steps=1, retime_steps=0)
    try:
        with rt.step():
            _step(a, 0)
        ops = [t.op for t in rt.trace.tensors if t.module == "blocks.1.1"]
        assert ops == ["addmm"]  # the layer norm's output, saved by the linear (it is named by the op that saves it)
        # the gelu saves the linear's output; the dropout mask is made in place (bernoulli_, div_)
        assert [t.op for t in rt.trace.tensors if t.module == "blocks.1.2"] == ["addmm"]
        assert [t.op for t in rt.trace.tensors if t.module == "blocks.1.3"] == ["div_"]
        assert all(sg.cheap for sg in rt._planned_on(rt.trace).segments)
    finally:
        rt.close()


def test_selective_checkpoints_save_the_kept_calls_train_bit_identically_and_hold_the_budget():
    a, b = Blocks(seed=3), Blocks(seed=3)
    rt = SwapRuntime(budget="50%", policy="checkpoint-selective", backend="cpu", model=a, audit=True,
                     profile_steps=1, retime_steps=0)
    try:
        reports = train_together(a, b, rt, 3, _step)
        assert [r.mode for r in reports] == ["profile", "profile", "execute"]
        assert reports[-1].selective_blocks == reports[-1].recomputed_blocks == ("blocks.0", "blocks.1", "blocks.2")
        # the profile as the steps now run: what the checkpoints keep is held from each block's
        # forward until its backward, outside the runtime's hooks
        # (R3, measured: beside what each block's forward makes and lets go, the same in each)
        held = [e.other_bytes or 0 for e in rt.trace.events[: rt.trace.backward_start]]
        assert max(held) - KEPT_PER_BLOCK in held and max(held) - 2 * KEPT_PER_BLOCK in held
        assert max(held) >= 3 * KEPT_PER_BLOCK
        # the last block's recompute, with all three blocks' kept tensors still held, rebuilds
        # gelu's output (it runs again, though only the cache's dropout output reads it) and the
        # mask: what the cache hands back is no new memory
        rebuilt = 2 * 4 * 32 * 256
        assert max(e.other_bytes or 0 for e in rt.trace.events) >= 3 * KEPT_PER_BLOCK + rebuilt
        last = reports[-1]
        assert last.plan_followed and last.measured_peak_bytes <= last.peak_device_bytes <= last.budget_bytes
        # the saved matmuls do not run again in backward: only the head, the input layer and the
        # two linears of each block run addmm, all in forward (whole checkpointing runs the first
        # linear of each block again)
        for blocks, extra in (("selective", 0), ("whole", 3)):
            if blocks == "whole":
                rt.use_plan(SwapPlan.of(rt._unwrapped_trace, "hand", [], recompute=[sg.name for sg in rt._unwrapped_trace.segments]))
                train_together(a, b, rt, 2, lambda m, i: _step(m, i + 3))
            count = _Count(torch.ops.aten.addmm.default)
            with count:
                train_together(a, b, rt, 1, lambda m, i: _step(m, i + 5))
            assert rt.report().mode == "execute"
            assert count.n == 2 * (2 + 2 * 3) + extra, blocks  # the runtime's model and its plain twin; its recomputes
    finally:
        rt.close()


class _DropoutBlock(nn.Module):
    """A block whose kept tensor is made by a random op: native_dropout (what dropout is on a
    GPU) feeds a linear, which saves it; a second dropout follows."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = torch.native_dropout(torch.tanh(self.fc1(x)), 0.3, True)
        h, _ = torch.native_dropout(torch.relu(self.fc2(h)), 0.3, True)
        return h


class _Dropouts(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.blocks = nn.ModuleList(_DropoutBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = x + blk(x)
        return x.pow(2).mean()


def test_a_random_op_runs_again_in_the_recompute_though_its_output_is_kept():
    # skipping the first dropout in the recompute would shift the RNG for the second: its mask,
    # and the gradients, would differ
    a, b = _Dropouts(), _Dropouts()
    rt = SwapRuntime(budget="100%", policy="checkpoint-selective", backend="cpu", model=a, profile_steps=1, retime_steps=0)
    try:
        reports = train_together(a, b, rt, 4, _step)
        assert reports[-1].mode == "execute" and reports[-1].selective_blocks == ("blocks.0", "blocks.1")
        # the first dropout's output is kept (the second linear saves it): the plan would save that call
        assert (torch.ops.aten.native_dropout.default, 0) in rt.blocks.saved["blocks.0"]
    finally:
        rt.close()


def test_a_selective_plan_that_holds_more_than_the_budget_checkpoints_those_blocks_whole():
    # at 50% the selective plan fits by the plan's trace, but the recompute runs gelu again (its
    # output is needed by nothing the cache lacks), a transient the plan does not count: the steps
    # as they run need more than the budget, so the blocks are checkpointed whole and profiled again
    a, b = Blocks(seed=3), Blocks(seed=3)
    rt = SwapRuntime(budget="50%", policy="checkpoint-selective", backend="cpu", model=a, audit=True,
                     profile_steps=1, retime_steps=0)
    try:
        reports = train_together(a, b, rt, 4, _wide_step)
        assert [r.mode for r in reports] == ["profile"] * 3 + ["execute"]
        assert [r.selective_blocks for r in reports[1:]] == [("blocks.0", "blocks.1", "blocks.2"), (), ()]
        last = reports[-1]
        assert last.recomputed_blocks == ("blocks.0", "blocks.1", "blocks.2")
        assert last.plan_followed and last.measured_peak_bytes <= last.peak_device_bytes <= last.budget_bytes
    finally:
        rt.close()


def test_a_policy_that_only_recomputes_needs_the_model():
    with pytest.raises(UserError, match="give it the model"):
        SwapRuntime(budget="60%", policy="checkpoint-all", backend="cpu")


def test_blocks_the_user_checkpoints_stay_theirs_and_autocast_composes():
    """A block the user already wraps in torch.utils.checkpoint saves only its input: it is no
    block of the trace, and the runtime checkpoints the others; under CPU autocast (bfloat16)."""
    from torch.utils.checkpoint import checkpoint

    class UserCheckpointed(Blocks):
        def forward(self, x):
            h = torch.tanh(self.inp(x))
            for i, blk in enumerate(self.blocks):
                h = h + (checkpoint(blk, h, use_reentrant=False) if i == 1 else blk(h))
            return self.head(h).float().pow(2).mean()

    def run(model, i):
        torch.manual_seed(i)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(X)
        loss.backward()
        return loss

    a, b = UserCheckpointed(seed=3), UserCheckpointed(seed=3)
    # the weights' bf16 casts are above the static bytes now, held only while used (R12): 80% of
    # that peak is below what the step needs at its fullest
    rt = SwapRuntime(budget="90%", policy=CheckpointAll(), backend="cpu", model=a, profile_steps=1)
    try:
        reports = train_together(a, b, rt, 5, run)
        assert reports[-1].mode == "execute" and reports[-1].recomputed_blocks == ("blocks.0", "blocks.2")
    finally:
        rt.close()
