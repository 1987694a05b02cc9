"""The attention kernel a profiled step runs, and what it saves for backward.

What ``F.scaled_dot_product_attention`` (SDPA) saves depends on the kernel it dispatches to:
- **flash** and **mem-efficient** save the inputs, the output and one log-sum-exp per query row
  (float32; mem-efficient pads the rows to a multiple of 32), and recompute the S x S
  probabilities in backward;
- **math** (and a model's own **eager** attention) saves the S x S softmax, in fp32 on the CPU.

The profiling machine rarely runs the kernel the target GPU would (there is no flash kernel on
``meta``, and SDPA on ``meta`` runs math). So under :class:`AttentionKernel` every SDPA call that
the chosen kernel is fused is answered by :class:`FlashLikeAttention`, an autograd function that
calls that kernel's aten ops directly (on ``meta`` their meta functions), so autograd saves what the
kernel saves and ``flop_counter`` counts its FLOPs (backward's five matmuls, the recomputed scores
among them). ``tests/test_attention.py`` checks its saved tensors and gradients against SDPA's own
CPU kernel.

The kernel defaults to what SDPA picks on the target hardware for each call's shapes
(:func:`choose_kernel`, after ``sdp_utils.cpp``'s checks in torch 2.13): flash where the GPU
has it and the call fits it, else mem-efficient, else math.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from swapsched.errors import UserError
from swapsched.hardware import Hardware

__all__ = ["KERNELS", "AttentionKernel", "FlashLikeAttention", "choose_kernel"]

#: What ``--attention`` takes. ``eager``: a model's own attention code (Hugging Face's
#: ``attn_implementation="eager"``); an SDPA call under it runs math.
KERNELS = ("flash", "mem-efficient", "math", "eager")
_HALF = (torch.float16, torch.bfloat16)
#: FlashAttention-2's largest head dimension (torch 2.13's sdp_utils check_head_dim_size_flash)
FLASH_MAX_HEAD_DIM = 256


def _why_not(kernel: str, q: torch.Tensor, attn_mask: torch.Tensor | None, hardware: Hardware) -> str | None:
    """Why SDPA could not run this call with ``kernel`` on ``hardware`` (None: it can)."""
    head_dim = q.shape[-1]
    on_cpu = hardware.kind == "cpu"
    if kernel == "flash":
        if on_cpu:
            return None  # the CPU's flash kernel takes every float dtype, masks and head size
        if hardware.bf16_peak_flops is None:  # bf16 units come with sm80, which FlashAttention-2 needs
            return f"{hardware.name} has no flash attention (it needs compute capability 8.0+)"
        if q.dtype not in _HALF:
            return f"flash attention runs in fp16 or bf16, not {str(q.dtype).replace('torch.', '')}"
        if head_dim > FLASH_MAX_HEAD_DIM or head_dim % 8:
            return f"flash attention takes head dimensions up to {FLASH_MAX_HEAD_DIM} in multiples of 8, not {head_dim}"
        if attn_mask is not None:
            return "flash attention takes no attention mask (only is_causal)"
        return None
    if kernel == "mem-efficient":
        if on_cpu:
            return "mem-efficient attention has no CPU kernel"
        if head_dim % (8 if q.dtype in _HALF else 4):
            return f"mem-efficient attention needs a head dimension in multiples of 8 (4 in fp32), not {head_dim}"
        return None
    return None  # math and eager run everything


def choose_kernel(requested: str | None, q: torch.Tensor, attn_mask: torch.Tensor | None, hardware: Hardware) -> str:
    """The kernel an SDPA call runs: ``requested``, or SDPA's first choice that can run it (flash,
    mem-efficient, math) where None. A requested kernel that cannot run the call is a UserError."""
    if requested is not None:
        if requested not in KERNELS:
            raise UserError(f"unknown attention kernel {requested!r}; use one of {', '.join(KERNELS)}")
        why = _why_not(requested, q, attn_mask, hardware)
        if why is not None:
            raise UserError(f"--attention {requested}: {why} (shape {list(q.shape)}); choose another kernel")
        return "math" if requested == "eager" else requested
    return next(k for k in ("flash", "mem-efficient", "math") if _why_not(k, q, attn_mask, hardware) is None)


class FlashLikeAttention(torch.autograd.Function):
    """SDPA through a fused kernel's own aten ops, chosen by the device they run on rather than by
    SDPA's dispatcher: the CUDA flash or mem-efficient kernels on CUDA and on ``meta`` (where their
    meta functions give shapes and ``flop_counter`` their FLOPs), the CPU's flash kernel on the CPU
    (which saves what the CUDA kernels save, the log-sum-exp's padding aside). Saves what the
    kernel's backward reads: inputs, output, log-sum-exp, its RNG state, a mask."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                dropout_p: float, is_causal: bool, scale: float, kernel: str) -> torch.Tensor:
        aten = torch.ops.aten
        if q.device.type == "cpu":
            # the CPU's kernel has no dropout; the CUDA kernels' dropout saves only its RNG state, so
            # what is saved is the same without it (the profiled step's numbers are not a dropout step's)
            dropout_p = 0.0
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask=mask,
                                                                         scale=scale)
            extra: tuple[Any, ...] = ()
        elif kernel == "flash":
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale)
            extra = (cum_q, cum_k, max_q, max_k, seed, offset)
        else:
            out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
                q, k, v, mask, True, dropout_p, is_causal, scale=scale)
            extra = (seed, offset)
        tensors = [x for x in extra if isinstance(x, torch.Tensor)]
        ctx.save_for_backward(q, k, v, out, lse, mask, *tensors)
        ctx.meta = (dropout_p, is_causal, scale, kernel, q.device.type, extra)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        q, k, v, out, lse, mask, *tensors = ctx.saved_tensors
        dropout_p, is_causal, scale, kernel, device_type, extra = ctx.meta
        it = iter(tensors)
        extra = tuple(next(it) if isinstance(x, torch.Tensor) else x for x in extra)  # the saved copies
        aten = torch.ops.aten
        if device_type == "cpu":
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask=mask, scale=scale)
        elif kernel == "flash":
            cum_q, cum_k, max_q, max_k, seed, offset = extra
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                grad_out.contiguous(), q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset,
                scale=scale)
        else:
            seed, offset = extra
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                grad_out.contiguous(), q, k, v, mask, out, lse, seed, offset, dropout_p, [True, True, True, False],
                is_causal, scale=scale)
        return dq, dk, dv, None, None, None, None, None


def _sdpa_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> tuple[Any, ...]:
    return q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa


class AttentionKernel(TorchFunctionMode):
    """Runs every ``F.scaled_dot_product_attention`` call as ``kernel`` would on ``hardware``
    (module docstring); ``kernel`` None: SDPA's own choice per call. ``used`` counts the calls per
    kernel that ran.

    Under autocast, SDPA is a lower-precision op: its floating inputs are cast to the autocast
    dtype here, where torch's dispatcher would have cast them, so autograd saves the casts."""

    def __init__(self, kernel: str | None, hardware: Hardware):
        super().__init__()
        if kernel is not None and kernel not in KERNELS:
            raise UserError(f"unknown attention kernel {kernel!r}; use one of {', '.join(KERNELS)}")
        self.kernel, self.hardware = kernel, hardware
        self.used: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, mask, dropout_p, is_causal, scale, _ = _sdpa_args(*args, **kwargs)
        device_type = q.device.type
        if device_type != "meta" and torch.is_autocast_enabled(device_type):
            low = torch.get_autocast_dtype(device_type)
            q, k, v = (x.to(low) if x.is_floating_point() else x for x in (q, k, v))
            if mask is not None and mask.is_floating_point():
                mask = mask.to(low)
        kernel = choose_kernel(self.kernel, q, mask, self.hardware)
        self.used[kernel] += 1
        if kernel == "math":
            return torch.ops.aten._scaled_dot_product_attention_math(
                q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])[0]
        if q.shape[1] % k.shape[1]:
            raise UserError(f"attention with {q.shape[1]} query heads and {k.shape[1]} key/value heads: "
                            "query heads must be a multiple of key/value heads")
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        if mask is not None and mask.dtype == torch.bool:  # the fused kernels take an additive bias
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        if kernel == "mem-efficient" and q.shape[1] != k.shape[1]:
            # it has no grouped-query support: SDPA repeats the key/value heads (and autograd saves the repeats)
            n = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
        return FlashLikeAttention.apply(q, k, v, mask, float(dropout_p), bool(is_causal), scale, kernel)
