"""integrations/hf.py: one line in a Hugging Face Trainer, bit-identical training."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from swapsched.errors import UserError  # noqa: E402
from swapsched.integrations.hf import swap_trainer  # noqa: E402


def _trainer(tmp_path, name, accumulate=1, **args):
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (32, 32), generator=gen)]
    extra = args
    args = transformers.TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=7,
                                          learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                                          use_cpu=True, seed=0, disable_tqdm=True,
                                          gradient_accumulation_steps=accumulate, **extra)
    return transformers.Trainer(model=model, args=args, train_dataset=data)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_one_line_trains_bit_identically_and_swaps(tmp_path, accumulate):
    plain, swapped = _trainer(tmp_path, "plain", accumulate), _trainer(tmp_path, "swapped", accumulate)
    runtime = swap_trainer(swapped, budget="60%", policy="min", backend="cpu", min_bytes=0, tune=False)  # the one line
    plain.train()
    swapped.train()
    rep = runtime.report()
    assert rep.mode == "execute" and rep.evicted_bytes > 0 and rep.peak_device_bytes <= rep.budget_bytes
    # a runtime step per micro-batch (accumulating, the second begins with gradients: from there
    # they count as static, R3, and the first's profile, which counted them from their birth, goes)
    assert rep.run.steps == 7 * accumulate and rep.run.executed == 7 * accumulate - 3
    assert not runtime.backend.d2h.is_alive()  # closed when training ended
    for p, q in zip(plain.model.parameters(), swapped.model.parameters(), strict=True):
        assert torch.equal(p, q)


def _padded_trainer(tmp_path, name, steps):
    """GPT-2 on sequences of 6-32 tokens, each batch padded to its longest (labels -100 there), as
    ``DataCollatorWithPadding`` pads a tokenizer's batches."""
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(6, 33, (4 * steps,), generator=gen).tolist()
    data = [{"input_ids": torch.randint(0, 128, (n,), generator=gen)} for n in lengths]

    def pad(batch):
        n = max(len(b["input_ids"]) for b in batch)
        ids = torch.zeros(len(batch), n, dtype=torch.long)
        mask = torch.zeros(len(batch), n, dtype=torch.long)
        for i, b in enumerate(batch):
            ids[i, : len(b["input_ids"])] = b["input_ids"]
            mask[i, : len(b["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    args = transformers.TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=steps,
                                          learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                                          use_cpu=True, seed=0, disable_tqdm=True, remove_unused_columns=False)
    return transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=pad)


def test_batches_padded_to_their_own_length_run_plans_bit_identically_within_budget(tmp_path):
    steps = 16
    plain, swapped = _padded_trainer(tmp_path, "plain", steps), _padded_trainer(tmp_path, "swapped", steps)
    runtime = swap_trainer(swapped, budget="70%", policy="min", backend="cpu", min_bytes=0, audit=True)
    reports = []
    swapped.add_callback(type("Reports", (transformers.TrainerCallback,), {
        "on_step_end": lambda self, *a, **k: reports.append(runtime.report())})())
    plain.train()
    swapped.train()
    for p, q in zip(plain.model.parameters(), swapped.model.parameters(), strict=True):
        assert torch.equal(p, q)
    later = reports[3:]
    assert len({r.step for r in later}) == len(later) == steps - 3
    executed = [r for r in later if r.mode == "execute"]
    # every step after the three profiling steps (of several lengths, each a member of the family)
    # runs a plan: its length's own, or one predicted from the lengths profiled
    assert len(executed) == len(later), [r.mode for r in reports]
    assert all(r.measured_peak_bytes <= r.budget_bytes for r in executed)  # the budget holds, by the meter


def test_a_compiling_trainer_runs_the_compiled_executor(tmp_path):
    # TrainingArguments(torch_compile=True): swap_trainer compiles the model in place with a
    # CompileBackend (aot_eager, as the trainer asks), installs no hooks, and trains exactly as
    # the same trainer compiling without swapsched
    from swapsched.deploy import CompileBackend

    compiling = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
    plain, swapped = _trainer(tmp_path, "plain", **compiling), _trainer(tmp_path, "swapped", **compiling)
    torch._dynamo.reset()
    backend = swap_trainer(swapped, budget="70%", policy="min", hardware="h100-pcie5")
    assert isinstance(backend, CompileBackend)
    swapped.train()
    torch._dynamo.reset()
    plain.train()
    report = backend.report()
    assert report.graphs and report.step is not None and report.step.within
    assert sum(g.offloaded for g in report.graphs) > 0
    for p, q in zip(plain.model.parameters(), swapped.model.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(UserError, match="torch_compile=True"):
        other = _trainer(tmp_path, "other", torch_compile=True)
        swap_trainer(other, budget="70%", backend="cpu")


def test_a_byte_budget_below_the_static_bytes_moves_the_state_of_the_optimizer_the_trainer_creates(tmp_path):
    # the trainer makes its AdamW as training starts: swap_trainer hands it to the runtime at the
    # first step, and a byte budget no plan of the activations alone meets moves the state (R13)
    from swapsched.runtime.profiler import profile

    plain, swapped = _trainer(tmp_path, "plain"), _trainer(tmp_path, "swapped")
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    trace = profile(_trainer(tmp_path, "probe").model, (ids,), lambda out: out.logits.float().square().mean(), state="adamw")
    # a quarter of the static bytes below what a plan of the activations alone needs (R3's
    # transients included: here the tied embedding's second gradient, as large as the weight)
    budget = trace.min_feasible_bytes - trace.static_bytes // 4
    # tune=False: its 7 steps end on an executed one (tuning's timing steps are test_two_stages.py's)
    runtime = swap_trainer(swapped, budget=budget, policy="default", backend="cpu", tune=False)
    plain.train()
    swapped.train()
    rep = runtime.report()
    assert rep.mode == "execute" and rep.state is not None and rep.state.placements
    assert rep.peak_device_bytes <= rep.budget_bytes
    for p, q in zip(plain.model.parameters(), swapped.model.parameters(), strict=True):
        assert torch.equal(p, q)


def _ddp_trainer_worker(rank: int, port: int, out: str, swap: bool) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    # accelerate runs 2 CPU processes as DDP (MULTI_CPU); it routes an FSDP config to DDP there too
    trainer = _trainer(out, f"ddp{int(swap)}", max_grad_norm=1.0)
    runtime = None
    if swap:  # below the smallest budget that keeps the state (2.65 MiB): the state moves
        runtime = swap_trainer(trainer, budget=2_400_000, policy="default", backend="cpu", audit=True)
    trainer.train()
    report = runtime.report() if runtime is not None else None
    torch.save({"type": type(trainer.model_wrapped).__name__, "params": [p.detach().clone() for p in trainer.model.parameters()],
                "placements": report.state.placements if report is not None and report.state is not None else (),
                "within": report is None or max(report.peak_device_bytes, report.measured_peak_bytes) <= 2_400_000},
               f"{out}/ddp{int(swap)}-{rank}.pt")


@pytest.mark.slow  # 13 s; DDP with the state moving is tests/runtime/test_ddp.py's
@pytest.mark.timeout(300)
def test_a_trainer_on_two_processes_trains_bit_identically_with_the_state_moving(tmp_path):
    import torch.multiprocessing as mp

    from swapsched.runtime.calibrate import free_port

    for swap in (False, True):
        mp.start_processes(_ddp_trainer_worker, args=(free_port(), tmp_path, swap), nprocs=2, join=True,
                           start_method="spawn")
    for rank in range(2):
        alone, swapped = (torch.load(tmp_path / f"ddp{s}-{rank}.pt") for s in (0, 1))
        assert swapped["type"] == "DistributedDataParallel" and swapped["placements"] and swapped["within"], swapped
        assert all(torch.equal(p, q) for p, q in zip(alone["params"], swapped["params"], strict=True))
