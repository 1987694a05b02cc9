"""Architectures outside the zoo, built on ``meta`` at training sizes and profiled there with
roofline timing: the held-out families of ``bench_policy.py --outside-zoo`` (a depthwise-separable
convnet, a recurrent LM, an MLP-Mixer and a ViT), none of which the planner's learned parts trained on."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from swapsched.trace import Trace


class DepthwiseNet(nn.Module):
    """MobileNet-style: a stem, then blocks of depthwise 3x3 and pointwise 1x1 convolutions."""

    def __init__(self, width: int = 128, depth: int = 12) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList([nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1, groups=width), nn.BatchNorm2d(width), nn.ReLU6(),
            nn.Conv2d(width, width, 1), nn.BatchNorm2d(width), nn.ReLU6()) for _ in range(depth)])
        self.head = nn.Linear(width, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=(2, 3)))


class RecurrentLM(nn.Module):
    """An embedding, a stack of single-layer LSTMs (one block each) and a vocabulary head."""

    def __init__(self, vocab: int = 32000, hidden: int = 1024, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([nn.LSTM(hidden, hidden, batch_first=True) for _ in range(layers)])
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for lstm in self.layers:
            h = h + lstm(h)[0]
        return self.head(h)


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.tokens = nn.Sequential(nn.Linear(tokens, 4 * tokens), nn.GELU(), nn.Linear(4 * tokens, tokens))
        self.channels = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class _PatchNet(nn.Module):
    """Image patches as tokens (``patch``), then ``blocks`` in turn, then ``head`` over the mean token."""

    patch: nn.Conv2d
    blocks: nn.ModuleList
    head: nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=1))


class Mixer(_PatchNet):
    """MLP-Mixer (Tolstikhin et al., 2021): patches, then token- and channel-mixing MLP blocks."""

    def __init__(self, dim: int = 512, depth: int = 8, image: int = 224, patch: int = 16) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.ModuleList([MixerBlock((image // patch) ** 2, dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 1000)


class ViT(_PatchNet):
    """A vision transformer from ``torch.nn.TransformerEncoderLayer`` (pre-norm), patch size 16."""

    def __init__(self, dim: int = 768, depth: int = 12, heads: int = 12, image: int = 224) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 16, stride=16)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                                                norm_first=True, activation="gelu")
                                     for _ in range(depth)])
        self.head = nn.Linear(dim, 1000)


#: name -> (model factory, input factory), each built on meta at a size a GPU user trains
OUTSIDE_ZOO: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "depthwise-12x128-b64": (DepthwiseNet, lambda: torch.zeros(64, 3, 224, 224)),
    "lstm-lm-4x1024-b64-s64": (RecurrentLM, lambda: torch.zeros(64, 64, dtype=torch.long)),
    "mixer-b16-d512-b64": (Mixer, lambda: torch.zeros(64, 3, 224, 224)),
    "vit-b16-b64": (ViT, lambda: torch.zeros(64, 3, 224, 224)),
}


def outside_zoo_traces(names: list[str] | None = None, precision: str | None = None) -> list[Trace]:
    """The ``OUTSIDE_ZOO`` models profiled on meta (roofline-timed for h100-pcie5, as the corpus's
    meta traces are; each case retimes for its link only through the copies). ``precision``:
    ``"bf16"`` (or ``"fp16"``) profiles them in that autocast over fp32 weights, as ``swapsched
    profile`` does for a GPU by default, and names them ``...-bf16``; None: in fp32."""
    from swapsched.precision import Precision
    from swapsched.runtime.profiler import profile

    out = []
    for name in names or list(OUTSIDE_ZOO):
        build, inputs = OUTSIDE_ZOO[name]
        torch.manual_seed(0)
        with torch.device("meta"):
            model, x = build(), inputs()
        out.append(profile(model, (x,), lambda o: o.float().pow(2).mean(), device="meta",
                           name=f"{name}-{precision}" if precision else name,
                           precision=Precision(precision, amp=True) if precision else None))
    return out
