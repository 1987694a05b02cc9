"""swapsched/attention.py: the kernel stand-in saves what SDPA's fused kernel saves, with its gradients."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from swapsched.attention import AttentionKernel, choose_kernel
from swapsched.errors import UserError
from swapsched.hardware import load_hardware

CPU, H100, V100 = (load_hardware(n) for n in ("cpu-emulated", "h100-pcie5", "v100-pcie3"))


def _step(mode: AttentionKernel | None, *, device: str = "cpu", dtype: torch.dtype = torch.float32, kv_heads: int = 2,
          causal: bool = True, mask: torch.Tensor | None = None, seq: int = 16):
    """Saved (shape, dtype) of one SDPA call, its output and the input gradients."""
    gen = torch.Generator().manual_seed(0)

    def leaf(heads: int) -> torch.Tensor:
        return torch.randn(2, heads, seq, 8, generator=gen).to(device=device, dtype=dtype).requires_grad_()

    q, k, v = leaf(4), leaf(kv_heads), leaf(kv_heads)
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append((tuple(t.shape), t.dtype)), t)[1], lambda t: t)
    with hooks, mode if mode is not None else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=kv_heads != 4)
    out.float().pow(2).sum().backward()
    return sorted(saved, key=str), out, (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_the_stand_in_saves_and_computes_what_sdpa_does_on_the_cpu(dtype, kv_heads):
    """On the CPU, SDPA's own flash kernel is the reference: the same saved tensors (shapes and
    dtypes, the float32 log-sum-exp among them), the same output and gradients, bit for bit."""
    ref_saved, ref_out, ref_grads = _step(None, dtype=dtype, kv_heads=kv_heads)
    mode = AttentionKernel(None, CPU)
    saved, out, grads = _step(mode, dtype=dtype, kv_heads=kv_heads)
    assert mode.used == {"flash": 1}
    assert saved == ref_saved
    assert ((2, 4, 16), torch.float32) in saved  # the log-sum-exp, one per query row
    assert not any(s[-2:] == (16, 16) for s, _ in saved)  # no S x S matrix
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def test_a_mask_is_saved_as_the_fused_kernel_saves_it():
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    ref_saved, _, ref_grads = _step(None, causal=False, mask=mask)
    saved, _, grads = _step(AttentionKernel(None, CPU), causal=False, mask=mask)
    assert saved == ref_saved and ((16, 16), torch.float32) in saved  # the additive bias the kernel reads
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, ref_grads, strict=True))


def test_on_meta_for_a_gpu_each_kernel_saves_its_own():
    # flash: q, k, v (grouped: 2 key/value heads), out, log-sum-exp and its RNG state; nothing S x S
    mode = AttentionKernel(None, H100)
    saved, _, _ = _step(mode, device="meta", dtype=torch.bfloat16, seq=64)
    assert mode.used == {"flash": 1}
    assert sorted(s for s, d in saved if d == torch.bfloat16) == [(2, 2, 64, 8), (2, 2, 64, 8), (2, 4, 64, 8), (2, 4, 64, 8)]
    assert ((2, 4, 64), torch.float32) in saved
    # fp32 on an H100: flash cannot, mem-efficient does, and it repeats the key/value heads first
    mode = AttentionKernel(None, H100)
    saved, _, _ = _step(mode, device="meta", seq=64)
    assert mode.used == {"mem-efficient": 1}
    assert sorted(s for s, d in saved if d == torch.float32 and len(s) == 4) == [(2, 4, 64, 8)] * 4
    # math keeps the S x S probabilities
    mode = AttentionKernel("math", H100)
    saved, _, _ = _step(mode, device="meta", seq=64)
    assert mode.used == {"math": 1} and any(s[-2:] == (64, 64) for s, _ in saved)


def test_sdpa_picks_by_hardware_dtype_and_shape():
    def q(dtype: torch.dtype, head_dim: int = 64) -> torch.Tensor:
        return torch.empty(1, 4, 8, head_dim, dtype=dtype, device="meta")

    mask = torch.empty(8, 8, device="meta")
    assert choose_kernel(None, q(torch.bfloat16), None, H100) == "flash"
    assert choose_kernel(None, q(torch.bfloat16), mask, H100) == "mem-efficient"  # flash takes no mask
    assert choose_kernel(None, q(torch.bfloat16, 512), None, H100) == "mem-efficient"  # beyond FA2's 256
    assert choose_kernel(None, q(torch.float16), None, V100) == "mem-efficient"  # no flash before sm80
    assert choose_kernel(None, q(torch.float32, 6), None, H100) == "math"  # mem-efficient needs multiples of 4
    assert choose_kernel(None, q(torch.float32), mask, CPU) == "flash"  # the CPU's flash takes it all
    assert choose_kernel("eager", q(torch.float32), None, H100) == "math"


@pytest.mark.parametrize(("kernel", "dtype", "hardware", "why"), [
    ("flash", torch.float32, H100, "fp16 or bf16"),
    ("flash", torch.float16, V100, "compute capability 8.0"),
    ("mem-efficient", torch.float32, CPU, "no CPU kernel"),
    ("nope", torch.float32, H100, "unknown attention kernel"),
])
def test_a_kernel_that_cannot_run_the_call_says_why(kernel, dtype, hardware, why):
    with pytest.raises(UserError, match=why):
        choose_kernel(kernel, torch.empty(1, 4, 8, 64, dtype=dtype, device="meta"), None, hardware)
