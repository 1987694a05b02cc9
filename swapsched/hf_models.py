"""Hugging Face architectures as training steps: ``hf:MODEL_TYPE``, built from the library's
config, or ``hf:PATH/config.json`` / ``hf:ORG/NAME``, built from the config of the model a user
trains (:func:`hf_config`).

No weights are downloaded: :func:`build_hf` makes ``transformers``' default configuration for a
``model_type`` (``size="full"``, the library's default model, e.g. a 7B Llama), or reads the
user's ``config.json`` (a file, a folder holding one, or a hub name whose config transformers
fetches when online; built at its own size unless ``size="small"``), with ``overrides`` set on it
(``{"num_hidden_layers": "4"}``, each an existing field), or a small one
(``size="small"``: 2 layers, width 128) shrunk *consistently*: attention heads with their key/value
heads and head size, feed-forward and expert widths, expert counts, the vocabulary with every
special token id inside it, and sub-configurations (an encoder's, a decoder's) alike.

The batch is what the family trains on, built from the config: token ids with labels for language
models (the model computes its own loss, as ``Trainer`` runs it), decoder labels for
encoder-decoders, ``pixel_values`` for vision, ``input_features`` for speech. The model is wrapped
in :class:`HFTrainingStep`, whose forward takes those tensors positionally and returns the loss.

A model type this cannot build (a multimodal one, whose batch mixes modalities; one with no
training head) raises :class:`HFModelError` with one line saying why and what to do instead.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from swapsched.errors import UserError

__all__ = ["HFModelError", "HFTrainingStep", "HFCase", "build_hf", "hf_config", "is_config_source", "one_line", "SMALL"]


class HFModelError(UserError):
    """A ``hf:`` model type that is unknown, or that cannot be built or stepped here."""


#: The small configuration: each setting under every name transformers' families give it
SMALL: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers", "encoder_layers",
               "decoder_layers"),
    "width": ("hidden_size", "n_embd", "d_model", "dim", "pooler_output_size"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
              "decoder_attention_heads"),
    "ffn": ("intermediate_size", "n_inner", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "ffn_dim"),
    "expert_ffn": ("moe_intermediate_size", "shared_expert_intermediate_size"),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
}
_SMALL_VALUES = {"layers": 2, "width": 128, "heads": 4, "ffn": 512, "expert_ffn": 128, "experts": 4}
#: Widths inside attention that other families split differently (rotary and latent dimensions, as
#: in GPT-J and DeepSeek's multi-head latent attention), each at most the small head dimension
_ATTENTION_WIDTHS = {"rotary_dim": 16, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32,
                     "kv_lora_rank": 32, "q_lora_rank": 64}
#: Routing settings that must fit the small expert count (DeepSeek's grouped routing)
_ROUTING = {"n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}
_HEAD_DIM = 32  # width 128 / 4 heads
_VOCAB = 1024
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "top_k", "moe_topk")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
              "cls_token_id", "mask_token_id", "unk_token_id")
_SUBCONFIGS = ("text_config", "vision_config", "audio_config", "encoder", "decoder")


def _set(config: Any, attr: str, value: Any) -> None:
    """Set ``attr`` where the config has it as a plain integer setting (not a derived property)."""
    if isinstance(getattr(config, attr, None), int) and not isinstance(getattr(config, attr), bool):
        with contextlib.suppress(AttributeError):  # a read-only property, derived from the settings shrunk here
            setattr(config, attr, value)


def _shrink(config: Any) -> None:
    """Shrink ``config`` in place to the small size, keeping it consistent (module docstring)."""
    heads_before = next((getattr(config, a) for a in SMALL["heads"] if isinstance(getattr(config, a, None), int)), None)
    staged = isinstance(getattr(config, "depths", None), (list, tuple))  # a convnet's stages: keep them, thin each
    for key, names in SMALL.items():
        if staged and key == "layers":
            continue  # its layer count is its stage count, which the per-stage widths must match
        for attr in names:
            _set(config, attr, _SMALL_VALUES[key])
    if staged:
        config.depths = [1] * len(config.depths)
        if isinstance(getattr(config, "hidden_sizes", None), (list, tuple)):
            config.hidden_sizes = [max(16, h // 8) for h in config.hidden_sizes]
    kv = getattr(config, "num_key_value_heads", None)
    if isinstance(kv, int) and heads_before:
        # keep the family's grouping: multi-head stays multi-head, grouped stays grouped (4 -> 2), MQA stays 1
        config.num_key_value_heads = 4 if kv >= heads_before else 1 if kv == 1 else 2
    for attr, value in _ATTENTION_WIDTHS.items():
        _set(config, attr, value)
    # a latent-attention family's head_dim is its rotary part (DeepSeek-V3); everyone else's the width / heads
    head_dim = _ATTENTION_WIDTHS["qk_rope_head_dim"] if isinstance(getattr(config, "qk_rope_head_dim", None), int) else _HEAD_DIM
    for attr in ("head_dim", "d_kv", "attention_head_dim"):
        _set(config, attr, head_dim)
    experts = next((getattr(config, a) for a in SMALL["experts"] if isinstance(getattr(config, a, None), int)), None)
    if experts:
        for attr in _EXPERTS_PER_TOKEN:
            _set(config, attr, min(getattr(config, attr, 2) or 2, 2, experts))
        for attr, value in _ROUTING.items():
            _set(config, attr, value)
    if isinstance(getattr(config, "vocab_size", None), int):
        config.vocab_size = _VOCAB
        for attr in _TOKEN_IDS:
            val = getattr(config, attr, None)
            if isinstance(val, int) and not 0 <= val < _VOCAB:
                setattr(config, attr, _VOCAB - 1 - _TOKEN_IDS.index(attr))
            elif isinstance(val, list):
                setattr(config, attr, [v if 0 <= v < _VOCAB else _VOCAB - 1 for v in val])
    if isinstance(getattr(config, "layer_types", None), list):
        with contextlib.suppress(AttributeError):  # derived from the layer count
            config.layer_types = config.layer_types[: _SMALL_VALUES["layers"]]
    _set(config, "image_size", 64)
    _set(config, "max_source_positions", 64)  # speech encoders: input frames / 2 after the conv stem
    for sub in _SUBCONFIGS:
        child = getattr(config, sub, None)
        if child is not None and hasattr(child, "to_dict"):
            _shrink(child)


class HFTrainingStep(nn.Module):
    """A ``transformers`` model as one training step: ``forward(*tensors)`` calls it with the
    batch's named inputs and returns its loss (``loss_fn`` is the identity)."""

    def __init__(self, hf: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.hf = hf
        self.names = names

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        out = self.hf(**dict(zip(self.names, tensors, strict=True)))
        loss = getattr(out, "loss", None)
        if loss is not None:
            return loss
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden.float().pow(2).mean()  # a model with no head: a loss over its last hidden state


@dataclass(frozen=True)
class HFCase:
    """What :func:`build_hf` returns (zoo wraps it as a ``ModelCase``)."""

    name: str
    model: HFTrainingStep
    inputs: tuple[torch.Tensor, ...]


def _mapping(name: str) -> dict[str, str]:
    import transformers.models.auto.modeling_auto as auto

    return dict(getattr(auto, name, {}))


def _head_class(model_type: str, task: str) -> str | None:
    """The class name the task's auto mapping builds for ``model_type`` (its first, where it lists several)."""
    found = _mapping(_MAPPINGS.get(task, "MODEL_MAPPING_NAMES")).get(model_type)  # "base": the bare model
    return found[0] if isinstance(found, (tuple, list)) else found


def _task(model_type: str) -> str:
    """Which head the family trains with (the first of the auto mappings that has it)."""
    for task, mapping in _MAPPINGS.items():
        if model_type in _mapping(mapping):
            return task
    return "base"


# the first auto mapping that has a model type names its task; an encoder such as BERT has a
# causal head too but trains masked, so masked-lm comes before causal-lm
_MAPPINGS = {"speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
             "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
             "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
             "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
             "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
             "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
             "multimodal": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"}


_AUTO_CLASS = {"speech-seq2seq": "AutoModelForSpeechSeq2Seq", "seq2seq": "AutoModelForSeq2SeqLM",
               "causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
               "image-classification": "AutoModelForImageClassification", "ctc": "AutoModelForCTC", "base": "AutoModel"}
#: Audio samples per training example of a CTC model (one second at 16 kHz)
_CTC_SAMPLES = 16000


def _batch(task: str, config: Any, b: int, t: int, gen: torch.Generator, float_dtype: torch.dtype
           ) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]]:
    """The family's training batch (module docstring), on the CPU."""
    def ids(n: int) -> torch.Tensor:
        vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
        if not vocab:
            raise HFModelError(f"hf:{config.model_type}: its config has no vocabulary size")
        return torch.randint(0, vocab, (b, n), generator=gen)

    if task in ("causal-lm", "masked-lm"):
        x = ids(t)
        return ("input_ids", "labels"), (x, x.clone())
    if task == "seq2seq":
        return ("input_ids", "labels"), (ids(t), ids(t))
    if task == "speech-seq2seq":
        frames = 2 * int(getattr(config, "max_source_positions", 1500))  # the conv stem halves the frames
        mels = int(getattr(config, "num_mel_bins", 80))
        feats = torch.randn(b, mels, frames, generator=gen).to(float_dtype)
        return ("input_features", "labels"), (feats, ids(min(t, int(getattr(config, "max_target_positions", t)))))
    if task == "image-classification":
        size = getattr(config, "image_size", 224)
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        pixels = torch.randn(b, int(getattr(config, "num_channels", 3)), h, w, generator=gen).to(float_dtype)
        labels = torch.randint(0, max(int(getattr(config, "num_labels", 2)), 1), (b,), generator=gen)
        return ("pixel_values", "labels"), (pixels, labels)
    if task == "ctc":
        audio = torch.randn(b, _CTC_SAMPLES, generator=gen).to(float_dtype)
        return ("input_values", "labels"), (audio, ids(min(t, 16)))  # a second of speech is a few tokens
    return ("input_ids",), (ids(t),)


def is_config_source(spec: str) -> bool:
    """A config of the user's (a path, or a hub name ORG/NAME), not a bare ``model_type``."""
    return "/" in spec or spec.endswith(".json") or Path(spec).exists()


def _parse_value(text: str) -> Any:
    """An override's value as JSON where it reads as JSON (4, 1e-5, true, [1, 2]), else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def hf_config(spec: str, overrides: Mapping[str, str] | None = None) -> tuple[Any, str, bool]:
    """The ``transformers`` config ``hf:SPEC`` names (module docstring), with ``overrides`` set:
    ``(config, short name, whether it is the user's own)``. Every failure is one line naming the
    file, the hub name or the field at fault."""
    try:
        import transformers
    except ImportError:
        raise HFModelError("hf: models need the optional extra: pip install 'swapsched[hf]'") from None
    own = is_config_source(spec)
    if not own:
        try:
            config = transformers.AutoConfig.for_model(spec)
        except (ValueError, KeyError):
            raise HFModelError(f"transformers {transformers.__version__} has no model_type {spec!r}") from None
        name = spec
    elif Path(spec).exists() or spec.endswith(".json"):
        path = Path(spec)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise HFModelError(f"hf:{spec}: no such file {str(file)!r}")
        try:
            fields = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HFModelError(f"hf:{spec}: {file} is not a JSON config ({one_line(exc)})") from None
        if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
            raise HFModelError(f"hf:{spec}: {file} has no 'model_type' field naming its architecture")
        model_type = fields.pop("model_type")
        try:
            config = transformers.AutoConfig.for_model(model_type, **fields)
        except (ValueError, KeyError):
            raise HFModelError(f"hf:{spec}: transformers {transformers.__version__} has no model_type {model_type!r}") from None
        except Exception as exc:
            raise HFModelError(f"hf:{spec}: transformers cannot read {file} ({one_line(exc)})") from None
        name = file.parent.name if file.name == "config.json" and file.parent.name else file.stem
    else:  # a hub name: its config.json alone, fetched by transformers (no weights)
        try:
            config = transformers.AutoConfig.from_pretrained(spec)
        except Exception as exc:
            raise HFModelError(f"hf:{spec}: cannot fetch its config.json ({one_line(exc)}); offline, download the "
                               "config.json and give hf:PATH/config.json") from None
        name = spec.rsplit("/", 1)[-1]
    for key, text in (overrides or {}).items():
        if key not in config.to_dict():
            raise HFModelError(f"--override {key}=...: the {config.model_type} config has no field {key!r}")
        try:
            setattr(config, key, _parse_value(text))
        except Exception as exc:
            raise HFModelError(f"--override {key}={text}: {one_line(exc)}") from None
    return config, name, own


def build_hf(source: str, size: str | None, batch_size: int | None, seq_len: int | None, device: str,
             seed: int, *, param_dtype: torch.dtype = torch.float32, attention: str | None = None,
             overrides: Mapping[str, str] | None = None) -> HFCase:
    """One training step of ``hf:SOURCE`` (module docstring) on ``device``. ``param_dtype``: the
    parameters' (and float inputs') dtype; ``attention``: ``"eager"`` builds the model's own
    attention code, anything else SDPA (which swapsched/attention.py then runs as that kernel)."""
    import transformers

    config, label, own = hf_config(source, overrides)
    model_type = config.model_type
    if size is None:
        size = "full" if own else "small"  # the user's own config: at its own size
    if size == "small":
        _shrink(config)
    elif size != "full":
        raise HFModelError(f"hf: models come in sizes 'small' (2 layers, width 128) or 'full' (the library default, "
                           f"or the given config as it is), not {size!r}")
    task = _task(model_type)
    if task == "multimodal":
        raise HFModelError(f"hf:{model_type}: a multimodal model (its batch mixes text and images); profile a factory "
                           "(package.module:function) that builds its batch")
    if task in ("seq2seq", "speech-seq2seq") and getattr(config, "decoder_start_token_id", None) is None:
        # the model shifts the labels right to make the decoder's inputs, starting from this id
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    b, t = batch_size or 2, seq_len or 64
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(limit, int) and task in ("causal-lm", "masked-lm", "seq2seq", "base") and t > limit:
        # rotary positions have no table to outgrow (long-context fine-tuning raises the field); a
        # learned table does, except in the small model, which is random anyway
        rotary = any(hasattr(config, a) for a in ("rope_theta", "rope_parameters", "rope_scaling"))
        if size not in (None, "small") and not rotary:
            raise HFModelError(f"hf:{model_type}: --seq-len {t} is longer than its {limit} learned positions")
        for attr in ("max_position_embeddings", "n_positions"):
            if hasattr(config, attr):
                setattr(config, attr, t)
    impl = {"eager": "eager", "flash": _FLASH}.get(attention or "", "sdpa")
    if impl == _FLASH:
        _register_flash()
    if getattr(config, "architectures", None) is None:
        # where a mapping lists several classes for a type, the auto class picks by this
        config.architectures = [c for c in [_head_class(model_type, task)] if c]
    torch.manual_seed(seed)
    auto = getattr(transformers, _AUTO_CLASS[task])
    try:
        with torch.device(device):
            try:
                hf = auto.from_config(config, attn_implementation=impl)
            except ValueError as exc:
                if impl == _FLASH:  # a family that takes no attention function: its SDPA code
                    hf = auto.from_config(config, attn_implementation="sdpa")
                elif impl != "sdpa" or "scaled_dot_product_attention" not in str(exc) and "sdpa" not in str(exc).lower():
                    raise
                else:
                    hf = auto.from_config(config, attn_implementation="eager")  # no SDPA code: its own (the trace says so)
    except Exception as exc:  # the library's own message, on one line: this config cannot be built here
        raise HFModelError(f"hf:{model_type}: transformers cannot build it ({one_line(exc)})") from None
    hf = hf.to(device=device, dtype=param_dtype)  # some families make a weight-norm parametrization on the CPU
    gen = torch.Generator().manual_seed(seed)
    names, tensors = _batch(task, config, b, t, gen, param_dtype)
    inputs = tuple(x.to(device) for x in tensors)
    name = f"hf-{label}" + ("-small" if own and size == "small" else "" if own else f"-{size}")
    return HFCase(name=name, model=HFTrainingStep(hf, names), inputs=inputs)


#: transformers' name for :func:`_flash_attention` (its AttentionInterface)
_FLASH = "swapsched_fused"  # a name with "flash" in it would be looked up on the hub


def _flash_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention as transformers' ``flash_attention_2`` runs it: causal by a flag and a sliding
    window by its size, never a mask tensor (the profiled batch has no padding, so the mask is only
    the causal or windowed structure). Through SDPA, which ``attention.AttentionKernel`` answers
    with the flash kernel. Without it SDPA gets the window as a mask tensor, which flash cannot
    take (Mistral past 4k tokens would run, and save, mem-efficient's S x S bias). The window is not
    applied: what the kernel saves is the same; its FLOPs are counted over the full causal square,
    as flop_counter counts every SDPA kernel."""
    if kwargs.get("position_bias") is not None:
        raise HFModelError(f"{type(module).__name__}: flash attention cannot add a position bias (T5's); "
                           "use --attention mem-efficient")
    causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True)) and query.shape[2] > 1
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout if module.training else 0.0, is_causal=bool(causal), scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _register_flash() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(_FLASH, _flash_attention)


def one_line(exc: BaseException) -> str:
    """An exception's first line, at most 200 characters: what a user reads of the library's error."""
    text = str(exc).strip().splitlines()
    msg = text[0] if text else type(exc).__name__
    return msg if len(msg) <= 200 else msg[:197] + "..."

