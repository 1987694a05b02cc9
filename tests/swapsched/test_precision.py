"""swapsched/precision.py: dtypes, and CUDA autocast's cast policy on meta tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from swapsched.errors import UserError
from swapsched.precision import MetaAutocast, Precision, autocast_for


def test_precision_names_what_the_step_computes_in():
    amp = Precision("bf16", amp=True)
    assert amp.param_dtype == torch.float32 and amp.compute_dtype == "bfloat16"
    assert amp.describe() == {"param_dtype": "float32", "compute_dtype": "bfloat16", "amp": True}
    pure = Precision("fp16", amp=False)
    assert pure.param_dtype == torch.float16 and pure.describe()["amp"] is False
    assert Precision("fp32", amp=True).amp is False  # autocast to fp32 is no autocast
    with pytest.raises(UserError, match="unknown dtype 'int8'"):
        Precision("int8")


def test_meta_autocast_casts_as_cuda_autocast_does():
    """Matmuls take bf16, softmax and norms fp32, the rest what they are given; autograd saves the
    casts (a linear saves its bf16 input), and a parameter's cast is the parameter's."""
    lin = nn.Linear(8, 8, device="meta")
    x = torch.randn(3, 8, device="meta", requires_grad=True)
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append((tuple(t.shape), t.dtype)), t)[1], lambda t: t)
    with hooks, MetaAutocast(torch.bfloat16):
        y = lin(x)
        z = y.softmax(-1)
        w = z + 1
    assert (y.dtype, z.dtype, w.dtype) == (torch.bfloat16, torch.float32, torch.float32)
    assert ((3, 8), torch.bfloat16) in saved  # the linear's cast input
    assert ((3, 8), torch.float32) in saved  # softmax's output, in fp32


def test_autocast_for_uses_torch_autocast_off_meta():
    lin = nn.Linear(8, 8)
    with autocast_for(Precision("bf16", amp=True), torch.device("cpu")):
        assert lin(torch.randn(2, 8)).dtype == torch.bfloat16
    with autocast_for(Precision("fp32"), torch.device("cpu")):
        assert lin(torch.randn(2, 8)).dtype == torch.float32
