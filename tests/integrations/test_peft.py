"""HF PEFT (LoRA): the frozen base weights placed like the rest of the state (R13), live and
bit-identical to the same PEFT loop without swapsched."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from swapsched.deploy import SwapRuntime  # noqa: E402
from swapsched.runtime.profiler import profile  # noqa: E402

BATCH = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))


def _lora_llama():
    """A small HF Llama (its embedding tied to the head: a frozen group that is also tied) with
    LoRA rank 4 on every projection; AdamW over the adapters only."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights="gaussian",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def _next_token(out) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), BATCH[:, 1:].flatten())


def _loss(model):
    return _next_token(model(BATCH))


def test_lora_moves_the_frozen_weights_and_trains_bit_identically(tmp_path):
    plain, plain_opt = _lora_llama()
    model, optimizer = _lora_llama()
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    trace = profile(_lora_llama()[0], (BATCH,), _next_token, name="lora-llama", state="adamw")
    assert {g.name for g in trace.state if g.frozen} >= {"base_model.model.model.layers.0/frozen",
                                                         "base_model.model.model.embed_tokens/frozen"}
    # half the frozen weights' bytes below the smallest budget that keeps the state on the device
    budget = trace.min_feasible_bytes - frozen // 2
    placed, executed = set(), 0
    with SwapRuntime(budget=budget, policy="default", model=model, optimizer=optimizer, backend="cpu", audit=True) as rt:
        for _ in range(8):
            for m, opt, runtime in ((plain, plain_opt, None), (model, optimizer, rt)):
                if runtime is None:
                    loss = _loss(m)
                    loss.backward()
                else:
                    with runtime.step():
                        loss = _loss(m)
                        loss.backward()
                    rep = runtime.report()
                    if rep.mode == "execute":
                        executed += 1
                        assert rep.state is not None and rep.peak_device_bytes <= budget and rep.measured_peak_bytes <= budget
                        placed |= {g for g, w in rep.state.placements if g.endswith("/frozen") and w == "full"}
                opt.step()
                opt.zero_grad()
                if runtime is None:
                    plain_loss = loss.detach()
            assert torch.equal(plain_loss, loss.detach())
    assert executed >= 3 and placed, placed  # frozen groups rested on the host, fetched for each use
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    for p, q in zip(plain_opt.param_groups[0]["params"], optimizer.param_groups[0]["params"], strict=True):
        assert all(torch.equal(plain_opt.state[p][k], optimizer.state[q][k]) for k in plain_opt.state[p])
    # the adapters' checkpoint is unchanged: the same files, byte for byte
    plain.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "swapped")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "swapped" / name).read_bytes(), name


def _lora_trainer(tmp_path, name):
    model, _ = _lora_llama()
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (24, 32), generator=torch.Generator().manual_seed(1))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=6,
                                          learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                                          use_cpu=True, seed=0, disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=data)


def test_a_trainer_on_a_lora_model_moves_its_frozen_weights_and_trains_the_same(tmp_path):
    from swapsched.integrations.hf import swap_trainer

    plain, swapped = _lora_trainer(tmp_path, "plain"), _lora_trainer(tmp_path, "swapped")
    frozen = sum(p.numel() * p.element_size() for p in swapped.model.parameters() if not p.requires_grad)
    trace = profile(_lora_llama()[0], (BATCH,), _next_token, name="lora-llama", state="adamw")
    runtime = swap_trainer(swapped, budget=trace.min_feasible_bytes - frozen // 2, policy="default", backend="cpu", audit=True)
    plain.train()
    swapped.train()
    rep = runtime.report()
    assert rep.mode == "execute" and rep.state is not None
    assert any(g.endswith("/frozen") and w == "full" for g, w in rep.state.placements), rep.state
    assert rep.peak_device_bytes <= rep.budget_bytes and rep.measured_peak_bytes <= rep.budget_bytes
    for p, q in zip(plain.model.parameters(), swapped.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_lightning_module_around_a_lora_model_moves_its_frozen_weights_and_trains_the_same():
    pl = pytest.importorskip("pytorch_lightning")
    from swapsched.integrations.lightning import SwapCallback

    class LoRA(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, _ = _lora_llama()

        def training_step(self, batch, batch_idx):
            return _next_token(self.model(batch[0]))

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def fit(callbacks):
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(BATCH.repeat(6, 1)), batch_size=4)
        module = LoRA()
        pl.Trainer(max_steps=6, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                   limit_val_batches=0).fit(module, loader)
        return module

    frozen = sum(p.numel() * p.element_size() for p in _lora_llama()[0].parameters() if not p.requires_grad)
    trace = profile(_lora_llama()[0], (BATCH,), _next_token, name="lora-llama", state="adamw")
    swap = SwapCallback(budget=trace.min_feasible_bytes - frozen // 2, policy="default", backend="cpu", audit=True)
    plain, swapped = fit([]), fit([swap])
    rep = swap.runtime.report()
    assert rep.mode == "execute" and rep.state is not None
    assert any(g.endswith("/frozen") and w == "full" for g, w in rep.state.placements), rep.state
    assert rep.peak_device_bytes <= rep.budget_bytes and rep.measured_peak_bytes <= rep.budget_bytes
    for p, q in zip(plain.parameters(), swapped.parameters(), strict=True):
        assert torch.equal(p, q)
