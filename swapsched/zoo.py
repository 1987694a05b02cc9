"""The model zoo: models users of this tool train, each with a synthetic batch and a loss.

``build_model("gpt", size="small")`` returns a :class:`ModelCase`. Families and their sizes are in
``configs/models/FAMILY.yaml``. Two more kinds of name are accepted:

- ``hf:MODEL_TYPE`` (e.g. ``hf:gpt2``): any ``transformers`` architecture, built from its config
  offline with random weights (needs the ``hf`` extra; nothing is downloaded);
- ``package.module:function``: a user's factory, called with the keyword arguments it accepts out of
  ``size, batch_size, seq_len, device, seed`` (torch is seeded with ``seed`` before the call, so two
  builds are the same model on the same batch) and returning a ``ModelCase`` or ``(model, inputs, loss_fn)``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

from swapsched._paths import config_dir
from swapsched.errors import UserError
from swapsched.hf_models import HFModelError, build_hf

__all__ = ["ModelCase", "ZooError", "build_model", "model_families", "family_sizes"]


class ZooError(UserError):
    """Unknown model name or size, or a factory that does not return a model."""


@dataclass(frozen=True)
class ModelCase:
    """A model ready to train: ``loss_fn(model(*inputs))`` is a scalar loss."""

    name: str
    model: nn.Module
    inputs: tuple[Any, ...]
    loss_fn: Callable[[Any], torch.Tensor]

    def loss(self) -> torch.Tensor:
        return self.loss_fn(self.model(*self.inputs))

    def timed_step(self, wrap: Callable[[], Any] | None = None) -> tuple[torch.Tensor, float]:
        """Forward and backward inside ``wrap()`` (a context such as ``runtime.step``), timed from a
        synchronized start to the device's end: the loss and the seconds. The one step harness of
        ``run``, the live env and calibration; gradients are the caller's to apply or clear."""
        cuda = next(self.model.parameters()).device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with wrap() if wrap is not None else contextlib.nullcontext():
            loss = self.loss()
            loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return loss, time.perf_counter() - t0


# ----------------------------------------------------------------------------- architectures


class MLP(nn.Module):
    def __init__(self, in_features: int, width: int, depth: int, classes: int):
        super().__init__()
        layers: list[nn.Module] = []
        d = in_features
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.GELU()]
            d = width
        layers.append(nn.Linear(d, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class VGG(nn.Module):
    def __init__(self, widths: Sequence[int], convs_per_stage: int, classes: int, image: int):
        super().__init__()
        layers: list[nn.Module] = []
        c = 3
        for w in widths:
            for _ in range(convs_per_stage):
                layers += [nn.Conv2d(c, w, 3, padding=1), nn.ReLU()]
                c = w
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        side = image // 2 ** len(widths)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c * side * side, 256), nn.ReLU(), nn.Linear(256, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, widths: Sequence[int], blocks: Sequence[int], classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        stages = []
        c = widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks, strict=False)):
            for j in range(n):
                stages.append(BasicBlock(c, w, 2 if (i > 0 and j == 0) else 1))
                c = w
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stages(self.stem(x))
        return self.head(y.mean(dim=(2, 3)))


class SelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        if self.causal:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            att = att.masked_fill(mask, float("-inf"))
        y = att.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    def __init__(self, d_model: int, heads: int, causal: bool, pre_ln: bool):
        super().__init__()
        self.pre_ln = pre_ln
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, heads, causal)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_ln:  # GPT-2
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))  # BERT
        return self.ln2(x + self.mlp(x))


class Transformer(nn.Module):
    """GPT-style (causal, pre-LN, tied head) or BERT-style (bidirectional, post-LN)."""

    def __init__(self, vocab: int, seq_len: int, layers: int, d_model: int, heads: int, causal: bool):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, heads, causal, pre_ln=causal) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)  # GPT-2's initialisation keeps the first logits small
        if causal:
            self.head.weight = self.tok.weight  # weight tying, as in GPT-2

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class UNet(nn.Module):
    def __init__(self, widths: Sequence[int], channels: int):
        super().__init__()

        def double(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())

        self.down = nn.ModuleList()
        c = channels
        for w in widths:
            self.down.append(double(c, w))
            c = w
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        for w in reversed(widths[:-1]):
            self.up.append(nn.ConvTranspose2d(c, w, 2, stride=2))
            self.merge.append(double(2 * w, w))
            c = w
        self.out = nn.Conv2d(c, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, blk in enumerate(self.down):
            x = blk(x)
            if i < len(self.down) - 1:
                skips.append(x)
                x = F.max_pool2d(x, 2)
        for up, merge in zip(self.up, self.merge, strict=False):
            x = merge(torch.cat([up(x), skips.pop()], dim=1))
        return self.out(x)


# ----------------------------------------------------------------------------- families


def _classify(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target)


def _build_family(family: str, cfg: dict[str, Any], device: str, gen: torch.Generator) -> tuple[nn.Module, tuple, Callable]:
    b = int(cfg["batch_size"])

    # drawn on the CPU, where the generator lives, then moved: inside ``torch.device("cuda")`` a
    # factory call without a device would draw on CUDA, which rejects a CPU generator
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cpu").to(device)

    def randint(high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=gen, device="cpu").to(device)

    if family == "mlp":
        model = MLP(cfg["in_features"], cfg["width"], cfg["depth"], cfg["classes"])
        x, y = rand(b, cfg["in_features"]), randint(cfg["classes"], b)
        return model, (x,), lambda out: _classify(out, y)
    if family in ("vgg", "resnet"):
        if family == "vgg":
            model = VGG(cfg["widths"], cfg["convs_per_stage"], cfg["classes"], cfg["image"])
        else:
            model = ResNet(cfg["widths"], cfg["blocks"], cfg["classes"])
        x, y = rand(b, 3, cfg["image"], cfg["image"]), randint(cfg["classes"], b)
        return model, (x,), lambda out: _classify(out, y)
    if family in ("gpt", "bert"):
        t, v = int(cfg["seq_len"]), int(cfg["vocab"])
        model = Transformer(v, t, cfg["layers"], cfg["d_model"], cfg["heads"], causal=(family == "gpt"))
        idx = randint(v, b, t + 1)
        x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
        if family == "bert":
            y = idx[:, :-1].contiguous()  # reconstruct the tokens (a masked-LM loss without the masking)
        return model, (x,), lambda out: F.cross_entropy(out.reshape(-1, v), y.reshape(-1))
    if family == "unet":
        c, s = int(cfg["channels"]), int(cfg["image"])
        model = UNet(cfg["widths"], c)
        x = rand(b, c, s, s)
        target = rand(b, c, s, s)
        return model, (x,), lambda out: F.mse_loss(out, target)
    raise AssertionError(family)


def model_families() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "models").glob("*.yaml"))


def _family_config(family: str) -> dict[str, Any]:
    path = config_dir() / "models" / f"{family}.yaml"
    if not path.is_file():
        raise ZooError(
            f"unknown model {family!r}; known: {', '.join(model_families())}, "
            "hf:MODEL_TYPE (transformers), or package.module:function"
        )
    return yaml.safe_load(path.read_text())


def family_sizes(family: str) -> list[str]:
    return list(_family_config(family)["sizes"])


def build_model(
    name: str,
    size: str | None = None,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attention: str | None = None,
    overrides: Mapping[str, str] | None = None,
) -> ModelCase:
    """Build a zoo model (random weights, synthetic batch) on ``device`` (``meta`` allocates nothing),
    its parameters and float inputs in ``dtype``. ``attention="eager"`` builds a ``hf:`` model's own
    attention code instead of SDPA; ``overrides`` set a ``hf:`` model's config fields (see
    swapsched/hf_models.py)."""
    if batch_size is not None and batch_size <= 0:
        raise ZooError(f"batch size must be positive, got {batch_size}")
    if seq_len is not None and seq_len <= 0:
        raise ZooError(f"sequence length must be positive, got {seq_len}")
    device = str(device)
    if overrides and not name.startswith("hf:"):
        raise ZooError(f"--override sets a hf: model's config fields; {name!r} is not a hf: model")
    if name.startswith("hf:"):
        try:
            hf = build_hf(name[3:], size, batch_size, seq_len, device, seed, param_dtype=dtype, attention=attention,
                          overrides=overrides)
        except HFModelError as exc:
            raise ZooError(str(exc)) from None
        return ModelCase(name=hf.name, model=hf.model, inputs=hf.inputs, loss_fn=_the_loss)
    if ":" in name:
        return _cast(_build_factory(name, size, batch_size, seq_len, device, seed), dtype)
    cfg_file = _family_config(name)
    sizes = cfg_file["sizes"]
    size = size or ("small" if "small" in sizes else next(iter(sizes)))
    if size not in sizes:
        raise ZooError(f"unknown size {size!r} for {name}; known: {', '.join(sizes)}")
    cfg = {**cfg_file.get("defaults", {}), **sizes[size]}
    if batch_size is not None:
        cfg["batch_size"] = batch_size
    if seq_len is not None:
        if "seq_len" not in cfg:
            raise ZooError(f"--seq-len applies to sequence models (gpt, bert), not to {name}")
        cfg["seq_len"] = seq_len
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.device(device):
        model, inputs, loss_fn = _build_family(name, cfg, device, gen)
    return _cast(ModelCase(name=f"{name}-{size}", model=model, inputs=inputs, loss_fn=loss_fn), dtype)


def _the_loss(out: torch.Tensor) -> torch.Tensor:
    return out  # HFTrainingStep's forward returns the model's own loss


def _cast(case: ModelCase, dtype: torch.dtype) -> ModelCase:
    """``case`` with its parameters, buffers and float inputs in ``dtype`` (pure low precision)."""
    if dtype == torch.float32:
        return case
    case.model.to(dtype)
    inputs = tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in case.inputs)
    return ModelCase(name=case.name, model=case.model, inputs=inputs, loss_fn=case.loss_fn)


def _build_factory(spec: str, size: str | None, batch_size: int | None, seq_len: int | None, device: str,
                   seed: int) -> ModelCase:
    mod_name, _, fn_name = spec.partition(":")
    # a factory in the folder the command runs in, as uvicorn and pytest find the user's module: a
    # console script's import path starts at its own install, not at the working directory
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ZooError(f"cannot load model factory {spec!r}: {exc}") from None
    offered = {"size": size, "batch_size": batch_size, "seq_len": seq_len, "device": device, "seed": seed}
    params = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in offered.items() if k in params and v is not None}
    # seeded like the zoo's own models: two builds of one factory are the same model on the same batch
    torch.manual_seed(seed)
    out = fn(**kwargs)
    if isinstance(out, ModelCase):
        return out
    if isinstance(out, tuple) and len(out) == 3 and isinstance(out[0], nn.Module):
        model, inputs, loss_fn = out
        return ModelCase(name=fn_name, model=model, inputs=tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), loss_fn=loss_fn)
    raise ZooError(f"model factory {spec!r} must return a ModelCase or (model, inputs, loss_fn), got {type(out).__name__}")
