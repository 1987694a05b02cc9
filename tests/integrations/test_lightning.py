"""integrations/lightning.py: one callback in a PyTorch Lightning Trainer, bit-identical training."""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

from swapsched.integrations.lightning import SwapCallback  # noqa: E402
from swapsched.zoo import build_model  # noqa: E402


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.case = build_model("mlp", "small", seed=0)
        self.net = self.case.model

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val", torch.nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(callbacks, accumulate=1, compile_with=None):
    """``Module`` trained 6 steps (with validation), or, given ``compile_with``, compiled with that
    backend and trained 4 steps without validation."""
    gen = torch.Generator().manual_seed(3)
    # batches of 64: the activations outweigh the weights' gradients, which no budget moves (R3)
    x, y = torch.randn(512, 256, generator=gen), torch.randint(0, 10, (512,), generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    module = Module()
    validate = {} if compile_with else {"limit_val_batches": 2, "val_check_interval": 4}
    trainer = pl.Trainer(max_steps=4 if compile_with else 6, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks, accumulate_grad_batches=accumulate,
                         **(validate or {"limit_val_batches": 0}))
    if compile_with:
        torch._dynamo.reset()
        trainer.fit(torch.compile(module, backend=compile_with), loader)
    else:
        trainer.fit(module, loader, loader)
    return module


@pytest.mark.parametrize("accumulate", [1, 2])
def test_one_callback_trains_bit_identically_and_swaps(accumulate):
    # every tensor swapped: with one batch a step, the step's fullest moment is AdamW's step inside
    # Lightning's closure (its temporaries, R3), where nothing saved is left to move
    swap = SwapCallback(budget="100%", policy="swap-all", backend="cpu", min_bytes=0, tune=False)
    plain, swapped = _fit([], accumulate), _fit([swap], accumulate)
    rep = swap.runtime.report()
    assert rep.mode == "execute" and rep.evicted_bytes > 0 and rep.peak_device_bytes <= rep.budget_bytes
    assert rep.run.steps == 6 * accumulate
    assert not swap.runtime.backend.d2h.is_alive()  # closed when fitting ended
    for p, q in zip(plain.parameters(), swapped.parameters(), strict=True):
        assert torch.equal(p, q)


class Sequences(pl.LightningModule):
    """Residual MLP blocks over (batch, length, 32), batches padded to their longest sequence."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 96),
                                                              torch.nn.GELU(), torch.nn.Linear(96, 32)) for _ in range(3))

    def training_step(self, batch, batch_idx):
        x, mask = batch
        h = x * 1.0  # the first saved tensor grows with the padded length
        for b in self.blocks:
            h = h + b(h)
        return (h.pow(2).mean(-1) * mask).sum() / mask.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _pad(batch):
    n = max(len(x) for x in batch)
    out, mask = torch.zeros(len(batch), n, 32), torch.zeros(len(batch), n)
    for i, x in enumerate(batch):
        out[i, : len(x)], mask[i, : len(x)] = x, 1.0
    return out, mask


def _fit_sequences(callbacks, steps):
    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(8, 41, (4 * steps,), generator=gen).tolist()
    data = [torch.randn(n, 32, generator=gen) for n in lengths]
    loader = torch.utils.data.DataLoader(data, batch_size=4, collate_fn=_pad)
    module = Sequences()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, loader)
    return module


def test_variable_lengths_run_plans_bit_identically_within_budget():
    steps = 16
    swap = SwapCallback(budget="60%", policy="min", backend="cpu", min_bytes=0, audit=True)
    reports = []

    class Reports(pl.Callback):  # after SwapCallback, which ends the step first
        def on_train_batch_end(self, *args, **kwargs):
            reports.append(swap.runtime.report())

    plain, swapped = _fit_sequences([], steps), _fit_sequences([swap, Reports()], steps)
    for p, q in zip(plain.parameters(), swapped.parameters(), strict=True):
        assert torch.equal(p, q)
    assert len(reports) == steps
    # three profiling steps, of two lengths, each of which gets a plan; every later length has a
    # plan (its own, or predicted from the two), and every step holds the budget by the meter too.
    # (The second step begins with the first's gradients, which Lightning zeroes after forward:
    # from there they count as static, R3, and the first step's profile goes.)
    assert [r.mode for r in reports] == ["profile"] * 3 + ["execute"] * (steps - 3)
    assert all(r.peak_device_bytes <= r.budget_bytes and r.measured_peak_bytes <= r.budget_bytes for r in reports[3:])
    assert reports[-1].run.shapes > 3 and reports[-1].run.predicted_steps > 0


def test_a_compiled_module_runs_the_compiled_executor():
    # fit(torch.compile(module)): the callback compiles its forward and training_step again with a
    # CompileBackend (no hooks), and training equals the same compiled module without swapsched
    from swapsched.deploy import CompileBackend

    swap = SwapCallback(budget="70%", policy="min", hardware="h100-pcie5", inner="aot_eager")
    plain, swapped = _fit([], compile_with="aot_eager"), _fit([swap], compile_with="aot_eager")
    assert isinstance(swap.runtime, CompileBackend)
    report = swap.runtime.report()
    assert report.graphs and report.step is not None and report.step.within
    for p, q in zip(plain.parameters(), swapped.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_byte_budget_below_the_static_bytes_moves_the_optimizer_it_creates(accumulate):
    # the optimizer Lightning creates (configure_optimizers) is attached at the first batch, its
    # state placed with the parameters (R13); the optimizer steps inside the callback's step
    from swapsched.runtime.profiler import profile

    case = build_model("mlp", "small", seed=0)
    trace = profile(case.model, case.inputs, case.loss_fn, name="mlp-small", state="adamw")
    budget = trace.min_feasible_bytes - trace.static_bytes // 4  # the state must move (as test_hf's)
    swap = SwapCallback(budget=budget, policy="default", backend="cpu")
    plain, swapped = _fit([], accumulate), _fit([swap], accumulate)
    rep = swap.runtime.report()
    assert rep.mode == "execute" and rep.state is not None and rep.state.placements
    assert rep.peak_device_bytes <= rep.budget_bytes
    for p, q in zip(plain.parameters(), swapped.parameters(), strict=True):
        assert torch.equal(p, q)
