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


def _fit(callbacks, accumulate=1):
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 256, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    module = Module()
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         accumulate_grad_batches=accumulate, limit_val_batches=2, val_check_interval=4)
    trainer.fit(module, loader, loader)
    return module


@pytest.mark.parametrize("accumulate", [1, 2])
def test_one_callback_trains_bit_identically_and_swaps(accumulate):
    swap = SwapCallback(budget="60%", policy="min", backend="cpu", min_bytes=0)
    plain, swapped = _fit([], accumulate), _fit([swap], accumulate)
    rep = swap.runtime.report()
    assert rep.mode == "execute" and rep.evicted_bytes > 0 and rep.peak_device_bytes <= rep.budget_bytes
    assert rep.run.steps == 6 * accumulate
    assert not swap.runtime.backend.d2h.is_alive()  # closed when fitting ended
    for p, q in zip(plain.parameters(), swapped.parameters(), strict=True):
        assert torch.equal(p, q)
