"""swapsched/zoo.py: families, sizes, factories, errors."""

from __future__ import annotations

import pytest
import torch

from swapsched.zoo import ModelCase, ZooError, build_model, family_sizes, model_families


def test_families_and_three_sizes_each():
    assert {"mlp", "vgg", "resnet", "gpt", "bert", "unet"} <= set(model_families())
    for f in model_families():
        assert len(family_sizes(f)) >= 3


@pytest.mark.parametrize("family", ["mlp", "vgg", "resnet", "gpt", "bert", "unet"])
def test_each_family_trains(family):
    case = build_model(family, "tiny")
    loss = case.loss()
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in case.model.parameters() if p.requires_grad)


def test_unknown_names_list_known_ones():
    with pytest.raises(ZooError, match="unknown model 'lstm'; known: bert, gpt, mlp"):
        build_model("lstm")
    with pytest.raises(ZooError, match="unknown size 'huge' for gpt; known: tiny, small"):
        build_model("gpt", "huge")
    with pytest.raises(ZooError, match="--seq-len applies to sequence models"):
        build_model("vgg", "tiny", seq_len=3)
    with pytest.raises(ZooError, match="batch size must be positive"):
        build_model("mlp", batch_size=0)


def tiny_factory(batch_size: int = 3):
    m = torch.nn.Linear(4, 2)
    return m, (torch.randn(batch_size, 4),), lambda y: y.pow(2).mean()


def test_user_factory():
    case = build_model("tests.swapsched.test_zoo:tiny_factory", batch_size=5)
    assert isinstance(case, ModelCase) and case.inputs[0].shape == (5, 4)
    # seeded: two builds are the same model on the same batch (what `run` compares bit for bit)
    again = build_model("tests.swapsched.test_zoo:tiny_factory", batch_size=5)
    assert torch.equal(case.inputs[0], again.inputs[0]) and torch.equal(case.model.weight, again.model.weight)
    with pytest.raises(ZooError, match="cannot load model factory"):
        build_model("no.such.module:f")
    with pytest.raises(ZooError, match="must return a ModelCase or"):
        build_model("tests.swapsched.test_zoo:not_a_model")


def not_a_model():
    return object()


class AddOnly(torch.nn.Module):
    """Saves no tensor for backward: an addition's gradient needs neither operand."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(8))

    def forward(self, x):
        return x + self.p


def saves_nothing():
    return AddOnly(), (torch.randn(4, 8),), lambda y: y.sum()


def test_a_model_that_saves_nothing_runs_and_says_there_is_nothing_to_swap(capsys):
    from swapsched.cli import main

    assert main(["run", "tests.swapsched.test_zoo:saves_nothing", "--steps", "4", "--backend", "cpu", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "nothing to swap" in out and "losses matched" in out


def test_hf_model_from_config_offline():
    pytest.importorskip("transformers")
    case = build_model("hf:gpt2", seq_len=16)
    loss = case.loss()
    assert torch.isfinite(loss)
    with pytest.raises(ZooError, match="no model_type"):
        build_model("hf:not-a-model")
