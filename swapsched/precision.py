"""The numeric precision a profiled step trains in: parameter dtype, autocast, and autocast on ``meta``.

Users train LLMs in bf16 autocast over fp32 master weights (``--dtype bf16 --amp``, the default
when profiling for a GPU), or in pure bf16/fp16 (``--no-amp``), or in fp32. Which one changes what
autograd saves (2 or 4 bytes an element) and how fast matmuls run (a trace's ``compute_dtype``
picks the hardware's peak when it is retimed).

``torch.autocast`` has no dispatch key for the ``meta`` device, so on meta :class:`MetaAutocast`
applies CUDA autocast's cast policy itself, at the ``__torch_function__`` level (above autograd, so
autograd saves the cast tensors as it would under real autocast): ops on autocast's lower-precision
list take their floating inputs in the autocast dtype, ops on its fp32 list take them in float32,
every other op runs in what its inputs are. The lists are those of
``aten/src/ATen/autocast_mode.cpp`` (torch 2.13), by op name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from swapsched.errors import UserError

__all__ = ["DTYPES", "Precision", "MetaAutocast", "autocast_for", "torch_dtype"]

#: What ``--dtype`` takes, and the torch dtype of each
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# autocast_mode.cpp, "lower_precision_fp" (CUDA): matmuls, convolutions, attention
_LOWER = frozenset({
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "lstm_cell",
    "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention", "__matmul__", "__rmatmul__",
    "_grouped_mm", "grouped_mm",
})
# autocast_mode.cpp, "fp32" (CUDA): reductions, norms, losses, transcendental pointwise ops
_FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "cross_entropy",
    "sum", "prod", "cumprod", "cumsum", "softmax", "log_softmax", "norm", "rms_norm",
})


def torch_dtype(name: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``; a clear error for anything else."""
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


class Precision:
    """How a step computes: parameters in ``dtype`` (pure) or fp32 under autocast to ``dtype``
    (``amp``). ``compute_dtype`` is what its matmuls run in."""

    def __init__(self, dtype: str = "fp32", amp: bool = False):
        self.dtype = torch_dtype(dtype)
        self.amp = bool(amp) and self.dtype != torch.float32  # autocast to fp32 is no autocast
        self.name = dtype

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.float32 if self.amp else self.dtype

    @property
    def compute_dtype(self) -> str:
        return str(self.dtype).replace("torch.", "")

    def describe(self) -> dict[str, Any]:
        """What a trace records (its ``meta``)."""
        return {"param_dtype": str(self.param_dtype).replace("torch.", ""), "compute_dtype": self.compute_dtype,
                "amp": self.amp}

    def __repr__(self) -> str:
        return f"{self.name} autocast" if self.amp else self.name


class MetaAutocast(TorchFunctionMode):
    """CUDA autocast's cast policy for meta tensors (module docstring). A parameter's cast is made
    anew at each use, as autocast does with its cache off, which the profiler and the runtime turn
    off (R12): a saved cast is the parameter's compute copy (``runtime/casts.py``), never a saved
    activation."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = self.dtype if name in _LOWER else torch.float32 if name in _FP32 else None
        if target is not None:
            def cast(x: Any) -> Any:
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != target and x.dtype != torch.float64:
                    return x.to(target)
                return x

            # inside the handler this mode is off: the casts are not dispatched back here
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return func(*args, **kwargs)


@contextmanager
def autocast_for(precision: Precision, device: torch.device) -> Iterator[None]:
    """Autocast as ``precision`` asks, on ``device`` (:class:`MetaAutocast` on meta)."""
    if not precision.amp:
        ctx: Any = nullcontext()
    elif device.type == "meta":
        ctx = MetaAutocast(precision.dtype)
    else:
        ctx = torch.autocast(device_type=device.type, dtype=precision.dtype)
    with ctx:
        yield
