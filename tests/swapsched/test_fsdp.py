"""swapsched.fully_shard (gloo, 2 processes on the CPU): FSDP2 wrapped per unit as rank 0's plan
says, the same on every rank, training exactly as FSDP2 without the plan's offload."""

from __future__ import annotations

import pytest
import torch

from swapsched.zoo import build_model
from tests.ranks import join_gloo, leave, run_ranks
from tests.runtime.test_fsdp import _gpt_sharded


def _worker(rank: int, world: int, port: int, out: str, budget: int) -> None:
    import swapsched
    from swapsched.runtime.profiler import static_bytes_of

    join_gloo(rank, world, port)
    runs = []
    for helper in (False, True):
        if helper:
            case = build_model("gpt", "tiny", seed=3)
            planned = swapsched.fully_shard(case.model, case.inputs, case.loss_fn, budget=budget)
        else:
            case = _gpt_sharded(3)
        optimizer = torch.optim.AdamW(case.model.parameters(), lr=1e-3)
        runtime = None
        if helper:  # the activations planned live on the wrapped model, at the same budget a rank
            runtime = swapsched.SwapRuntime(budget=planned.budget_bytes, model=case.model, optimizer=optimizer,
                                            backend="cpu", audit=True)
        losses, peaks = [], []
        for i in range(6):
            torch.manual_seed(1000 * rank + i)  # each rank its own batches
            x = torch.randint(0, 128, case.inputs[0].shape)
            if runtime is not None:
                with runtime.step():
                    loss = case.loss_fn(case.model(x))
                    loss.backward()
                report = runtime.report()
                if report.mode == "execute":
                    peaks.append((report.peak_device_bytes, report.measured_peak_bytes))
            else:
                loss = case.loss_fn(case.model(x))
                loss.backward()
            losses.append(loss.detach())
            torch.nn.utils.clip_grad_norm_(case.model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        run = {"losses": losses, "params": [p.full_tensor() for p in case.model.parameters()]}
        if helper:
            runtime.close()
            units = {}  # what FSDP2 was given per unit, read off its own state
            for name, mod in case.model.named_modules():
                if isinstance(mod, _fsdp_module_class()) and mod._get_fsdp_state()._fsdp_param_group is not None:
                    group = mod._get_fsdp_state()._fsdp_param_group
                    units[name] = (group.fsdp_params[0].offload_to_cpu, group.post_forward_mesh_info is not None)
            # the bytes FSDP2 keeps on the host: each offloaded shard's storage (padded to the
            # largest rank's), its gradient counted as large, AdamW's two moments and its step count
            host = sum(2 * fp.sharded_param.to_local().untyped_storage().nbytes() + 2 * fp.sharded_param.to_local().numel() * 4 + 4
                       for mod in case.model.modules()
                       if isinstance(mod, _fsdp_module_class()) and mod._get_fsdp_state()._fsdp_param_group is not None
                       for fp in mod._get_fsdp_state()._fsdp_param_group.fsdp_params if fp.offload_to_cpu)
            run.update(planned=planned, units=units, peaks=peaks, host=host)
        run["static"] = static_bytes_of(case.model, optimizer)
        runs.append(run)
    leave(runs, out, rank)


def _fsdp_module_class():
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


@pytest.mark.timeout(300)
def test_fully_shard_wraps_every_rank_as_rank_0_planned_and_trains_exactly(tmp_path):
    runs = run_ranks(_worker, tmp_path, 1_800_000)
    assert runs[0][1]["planned"] == runs[1][1]["planned"]  # one plan, broadcast
    for plain, wrapped in runs:
        planned = wrapped["planned"]
        # a fraction of the units offloaded: what FSDP2's own policy cannot say in one wrap
        assert planned.offloaded and set(planned.offloaded) < set(planned.plan.placement()) | {"ln_f"}
        assert planned.peak_bytes <= planned.budget_bytes == 1_800_000
        for unit, (offloaded, resharded) in wrapped["units"].items():
            if unit:  # the root's own parameters: the groups outside the blocks it holds
                assert offloaded == (unit in planned.offloaded), unit
                assert resharded == (unit not in planned.unsharded), unit
        # the runtime counts on the device what FSDP2 does not keep on the host
        assert wrapped["host"] > 0 and wrapped["static"] == plain["static"] - wrapped["host"]
        assert all(torch.equal(a, b) for a, b in zip(plain["losses"], wrapped["losses"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(plain["params"], wrapped["params"], strict=True))
        # every executed step of the runtime on the wrapped model within the rank's budget, by both meters
        assert wrapped["peaks"] and all(max(p) <= planned.budget_bytes for p in wrapped["peaks"]), wrapped["peaks"]


def _refused_worker(rank: int, world: int, port: int, out: str) -> None:
    import swapsched
    from swapsched.budget import BudgetError

    join_gloo(rank, world, port)
    case = build_model("gpt", "tiny", seed=3)
    message = ""
    try:
        swapsched.fully_shard(case.model, case.inputs, case.loss_fn, budget=200_000)
    except BudgetError as exc:
        message = str(exc)
    leave(message, out, rank)


@pytest.mark.timeout(120)
def test_a_budget_no_plan_fits_is_the_same_budget_error_on_every_rank(tmp_path):
    messages = run_ranks(_refused_worker, tmp_path)
    assert messages[0] == messages[1] and "is below what any plan can meet" in messages[0], messages


def test_fully_shard_without_a_process_group_says_what_to_do():
    import swapsched
    from swapsched.errors import UserError

    case = build_model("gpt", "tiny", seed=0)
    with pytest.raises(UserError, match="init_process_group"):
        swapsched.fully_shard(case.model, case.inputs, case.loss_fn, budget=10**6)
