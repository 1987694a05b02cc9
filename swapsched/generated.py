"""Random architectures: a far wider set than the zoo, for the planner's learned parts to train on.

``random_architecture(seed)`` draws one network from a space of modern building blocks and returns
it as a :class:`~swapsched.zoo.ModelCase` (build it on ``meta`` and profile it there, as
``scripts/build_traces.py`` does for the corpus's ``generated`` split). The space:

- **token models** (an embedding, ``blocks``, a vocabulary head): pre- or post-norm attention,
  LayerNorm or RMSNorm, MLPs of ratio 2-4 with GELU, SiLU or ReLU, gated (SwiGLU) MLPs and 1-d
  convolution token mixers, interleaved in a pattern of one or two kinds (as hybrid models stack them);
- **image models** (a convolution stem, ``blocks`` in 2-4 stages of halving resolution, a pooled
  head): residual basic and bottleneck blocks, plain conv-norm-activation blocks, squeeze-and-
  excitation and dilated convolutions, BatchNorm or GroupNorm;
- **vector models** (``blocks`` of residual MLPs of varied widths, norms and dropout).

Widths, depths, batch and sequence sizes are drawn so that a step is GPU-sized (milliseconds) and
the traces range from tens to several hundred saved tensors. Every block is an element of the
``blocks`` ``ModuleList``, so the profiler finds them as recomputable segments (R9).

Deliberately not in the space: recurrent cells, depthwise convolutions and token-mixing MLPs, which
``scripts/_outside_zoo.py`` holds out as architectures the planner never trained on.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from swapsched.errors import UserError
from swapsched.zoo import ModelCase

__all__ = ["random_architecture", "describe"]

_ACTS: dict[str, Callable[[], nn.Module]] = {"gelu": nn.GELU, "silu": nn.SiLU, "relu": nn.ReLU}


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang and Sennrich, 2019), written out so that it records its own ops."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(kind: str, d: int) -> nn.Module:
    return RMSNorm(d) if kind == "rms" else nn.LayerNorm(d)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool, dropout: float) -> None:
        super().__init__()
        self.heads, self.causal, self.dropout = heads, causal, dropout
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        if self.causal:
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        att = F.dropout(att.softmax(dim=-1), self.dropout, self.training)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, d: int, ratio: int, act: str, gated: bool, dropout: float) -> None:
        super().__init__()
        h = d * ratio
        self.gated = gated
        self.up = nn.Linear(d, 2 * h if gated else h)
        self.act, self.down, self.drop = _ACTS[act](), nn.Linear(h, d), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.gated:  # SwiGLU-style (Shazeer, 2020): one half gates the other
            a, g = h.chunk(2, dim=-1)
            h = a * self.act(g)
        else:
            h = self.act(h)
        return self.drop(self.down(h))


class ConvMixer1d(nn.Module):
    """A causal 1-d convolution over the tokens (full channels), as convolutional hybrids mix."""

    def __init__(self, d: int, kernel: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.conv, self.proj = nn.Conv1d(d, d, kernel), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(F.pad(x.transpose(1, 2), (self.kernel - 1, 0))).transpose(1, 2)
        return self.proj(F.silu(y))


class TokenBlock(nn.Module):
    """One residual block of a token model: ``mixer`` (attention, conv or none) and an MLP."""

    def __init__(self, d: int, spec: dict[str, Any]) -> None:
        super().__init__()
        self.pre = spec["pre_norm"]
        self.n1, self.n2 = _norm(spec["norm"], d), _norm(spec["norm"], d)
        kind = spec["kind"]
        self.mixer: nn.Module | None = (Attention(d, spec["heads"], spec["causal"], spec["dropout"]) if kind == "attention"
                                        else ConvMixer1d(d, spec["kernel"]) if kind == "conv" else None)
        self.mlp = Mlp(d, spec["ratio"], spec["act"], kind == "gated" or spec["gated"], spec["dropout"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre:
            if self.mixer is not None:
                x = x + self.mixer(self.n1(x))
            return x + self.mlp(self.n2(x))
        if self.mixer is not None:
            x = self.n1(x + self.mixer(x))
        return self.n2(x + self.mlp(x))


class ConvBlock(nn.Module):
    """One block of an image model: ``basic`` (two 3x3), ``bottleneck`` (1x1, 3x3, 1x1) or ``plain``
    (one 3x3, no skip), optionally dilated and with squeeze-and-excitation (Hu et al., 2018)."""

    def __init__(self, cin: int, cout: int, stride: int, spec: dict[str, Any]) -> None:
        super().__init__()
        kind, dil = spec["kind"], spec["dilation"] if stride == 1 else 1
        groups = 8 if spec["norm"] == "group" else 0

        def norm(c: int) -> nn.Module:
            return nn.GroupNorm(math.gcd(groups, c), c) if groups else nn.BatchNorm2d(c)

        act = _ACTS[spec["act"]]
        if kind == "plain":
            layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, stride, dil, dilation=dil, bias=False), norm(cout), act()]
        elif kind == "basic":
            layers = [nn.Conv2d(cin, cout, 3, stride, dil, dilation=dil, bias=False), norm(cout), act(),
                      nn.Conv2d(cout, cout, 3, 1, 1, bias=False), norm(cout)]
        else:
            mid = max(cout // 4, 8)
            layers = [nn.Conv2d(cin, mid, 1, bias=False), norm(mid), act(),
                      nn.Conv2d(mid, mid, 3, stride, dil, dilation=dil, bias=False), norm(mid), act(),
                      nn.Conv2d(mid, cout, 1, bias=False), norm(cout)]
        self.body = nn.Sequential(*layers)
        self.se = (nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(cout, max(cout // 16, 4), 1), nn.ReLU(),
                                 nn.Conv2d(max(cout // 16, 4), cout, 1), nn.Sigmoid()) if spec["se"] else None)
        self.skip = kind != "plain"
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))
                     if self.skip and (stride != 1 or cin != cout) else None)
        self.out_act = act() if self.skip else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        if self.se is not None:
            y = y * self.se(y)
        if self.out_act is None:
            return y
        return self.out_act(y + (x if self.down is None else self.down(x)))


class VectorBlock(nn.Module):
    """A residual MLP block of a vector model (norm, up, activation, dropout, down)."""

    def __init__(self, d: int, spec: dict[str, Any]) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d) if spec["norm"] == "layer" else nn.BatchNorm1d(d)
        self.mlp = Mlp(d, spec["ratio"], spec["act"], spec["gated"], spec["dropout"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class GeneratedNet(nn.Module):
    """``stem``, then ``blocks`` in order, then ``head`` (pooled over tokens or pixels)."""

    def __init__(self, stem: nn.Module, blocks: list[nn.Module], head: nn.Module, pool: str) -> None:
        super().__init__()
        self.stem, self.blocks, self.head, self.pool = stem, nn.ModuleList(blocks), head, pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        if self.pool == "pixels":
            x = x.mean(dim=(2, 3))
        return self.head(x)


def _draw(seed: int) -> dict[str, Any]:
    """The architecture's description: every choice drawn from ``seed``."""
    rng = random.Random(seed)
    kind = rng.choice(["tokens", "tokens", "image", "image", "vector"])
    act, drop = rng.choice(list(_ACTS)), rng.choice([0.0, 0.0, 0.1])
    if kind == "tokens":
        d = rng.choice([256, 384, 512, 768, 1024, 1536, 2048])
        heads = rng.choice([h for h in (4, 8, 12, 16, 32) if d % h == 0 and d // h >= 32])
        kinds = rng.sample(["attention", "attention", "gated", "conv", "mlp"], rng.choice([1, 2]))
        depth = rng.randint(2, 24)
        seq = rng.choice([128, 256, 512, 1024, 2048])
        every = rng.randint(1, 4)  # the second kind at every ``every``-th block
        blocks = [{"kind": kinds[1] if len(kinds) > 1 and i % every == every - 1 else kinds[0], "heads": heads,
                   "causal": rng.random() < 0.7, "pre_norm": rng.random() < 0.75, "norm": rng.choice(["layer", "rms"]),
                   "ratio": rng.choice([2, 3, 4]), "act": act, "gated": rng.random() < 0.3, "dropout": drop,
                   "kernel": rng.choice([3, 4, 7])} for i in range(depth)]
        shared = {k: blocks[0][k] for k in ("causal", "pre_norm", "norm", "ratio", "gated", "kernel")}
        blocks = [{**b, **shared} for b in blocks]  # one style per model, as real models have
        tokens = max(1024, 2 ** rng.randint(13, 15) // seq * seq)  # 8k-32k tokens a batch
        return {"kind": kind, "d": d, "seq": seq, "batch": max(tokens // seq, 1), "vocab": rng.choice([8192, 32000, 50304]),
                "blocks": blocks}
    if kind == "image":
        stages = rng.randint(2, 4)
        w0 = rng.choice([32, 64, 96, 128])
        style = {"kind": rng.choice(["basic", "bottleneck", "plain"]), "norm": rng.choice(["batch", "batch", "group"]),
                 "se": rng.random() < 0.3, "act": act, "dilation": rng.choice([1, 1, 2])}
        widths = [w0]
        for _ in range(stages - 1):  # each stage 1.5x or 2x wider, as ResNets and RegNets grow
            widths.append(min(int(widths[-1] * rng.choice([1.5, 2, 2])) // 32 * 32, 1024))
        per = [rng.randint(1, 4) for _ in range(stages)]
        image = rng.choice([64, 96, 128, 160, 224])
        return {"kind": kind, "image": image, "batch": rng.choice([16, 32, 64, 128]) * max(1, (224 // image) ** 2 // 2),
                "widths": widths, "per_stage": per, "block": style, "classes": 1000}
    d = rng.choice([512, 1024, 2048, 4096])
    blocks = [{"norm": rng.choice(["layer", "batch"]), "ratio": rng.choice([1, 2, 4]), "act": act,
               "gated": rng.random() < 0.3, "dropout": drop} for _ in range(rng.randint(2, 16))]
    return {"kind": kind, "d": d, "in": rng.choice([256, 784, 1024, 3072]), "batch": rng.choice([4096, 8192, 16384]),
            "blocks": [{**blocks[0], "ratio": b["ratio"]} for b in blocks], "classes": rng.choice([10, 100, 1000])}


def describe(seed: int) -> str:
    """A one-line summary of the architecture ``seed`` draws (what ``build_traces.py`` records)."""
    a = _draw(seed)
    if a["kind"] == "tokens":
        kinds = "+".join(sorted({b["kind"] for b in a["blocks"]}))
        return f"tokens {kinds} x{len(a['blocks'])} d{a['d']} seq{a['seq']} b{a['batch']}"
    if a["kind"] == "image":
        return f"image {a['block']['kind']} {a['per_stage']}x{a['widths']} {a['image']}px b{a['batch']}"
    return f"vector x{len(a['blocks'])} d{a['d']} b{a['batch']}"


def random_architecture(seed: int, *, device: str | torch.device = "meta") -> ModelCase:
    """The network ``seed`` draws, with a synthetic batch and a cross-entropy loss, on ``device``."""
    if seed < 0:
        raise UserError(f"a random architecture's seed must be non-negative, got {seed}")
    a = _draw(seed)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    b = int(a["batch"])
    with torch.device(device):
        if a["kind"] == "tokens":
            d, v = a["d"], a["vocab"]
            net = GeneratedNet(nn.Embedding(v, d), [TokenBlock(d, s) for s in a["blocks"]],
                               nn.Sequential(_norm(a["blocks"][0]["norm"], d), nn.Linear(d, v, bias=False)), "none")
            x = torch.randint(0, v, (b, a["seq"]), generator=gen, device="cpu").to(device)
            y = torch.randint(0, v, (b, a["seq"]), generator=gen, device="cpu").to(device)
            return ModelCase(f"generated-{seed}", net, (x,), lambda out: F.cross_entropy(out.reshape(-1, v), y.reshape(-1)))
        if a["kind"] == "image":
            blocks: list[nn.Module] = []
            c = a["widths"][0]
            for i, (w, n) in enumerate(zip(a["widths"], a["per_stage"], strict=True)):
                for j in range(n):
                    blocks.append(ConvBlock(c, w, 2 if i and not j else 1, a["block"]))
                    c = w
            stem = nn.Sequential(nn.Conv2d(3, a["widths"][0], 3, 1, 1, bias=False), nn.BatchNorm2d(a["widths"][0]), nn.ReLU())
            net = GeneratedNet(stem, blocks, nn.Linear(c, a["classes"]), "pixels")
            x = torch.randn(b, 3, a["image"], a["image"], generator=gen, device="cpu").to(device)
        else:
            net = GeneratedNet(nn.Linear(a["in"], a["d"]), [VectorBlock(a["d"], s) for s in a["blocks"]],
                               nn.Linear(a["d"], a["classes"]), "none")
            x = torch.randn(b, a["in"], generator=gen, device="cpu").to(device)
        y = torch.randint(0, a["classes"], (b,), generator=gen, device="cpu").to(device)
    return ModelCase(f"generated-{seed}", net, (x,), lambda out: F.cross_entropy(out, y))
