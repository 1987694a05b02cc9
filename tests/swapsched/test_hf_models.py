"""swapsched/hf_models.py with `swapsched profile hf:TYPE`: the families users fine-tune profile,
in their dtype and with their attention kernel, or say why in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from swapsched.cli import main
from swapsched.precision import Precision
from swapsched.runtime.profiler import profile
from swapsched.trace_file import load_trace
from swapsched.zoo import build_model

transformers = pytest.importorskip("transformers")

#: Decoders, mixtures of experts, encoders, encoder-decoders, speech, vision and a state-space model
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe",
            "deepseek_v3", "phi", "phi3", "falcon", "gpt2", "gptj", "gpt_neox", "opt", "bloom", "mpt", "olmo",
            "stablelm", "starcoder2", "bert", "roberta", "distilbert", "deberta-v2", "t5", "bart", "whisper", "vit",
            "deit", "swin", "convnext", "mamba"]
#: Families whose forward uses SDPA in transformers, so the trace has the fused kernel's tensors
SDPA = {"llama", "mistral", "qwen2", "qwen3", "mixtral", "phi3", "gpt2", "bert", "t5", "whisper", "vit"}


SOFTMAX = {"_softmax", "softmax", "_safe_softmax"}


def _known(model_type: str) -> None:
    try:
        transformers.AutoConfig.for_model(model_type)
    except (ValueError, KeyError):
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_family_profiles_for_a_gpu(model_type, tmp_path, capsys):
    _known(model_type)
    out = tmp_path / "t.json"
    assert main(["profile", f"hf:{model_type}", "--device", "meta", "--hardware", "h100-pcie5", "--out", str(out)]) == 0
    trace = load_trace(out)
    assert trace.meta["compute_dtype"] == "bfloat16" and trace.meta["amp"] is True
    assert trace.n_tensors > 10 and trace.static_bytes > 0
    if model_type in SDPA:
        used = trace.meta["attention"]
        assert set(used) <= {"flash", "mem-efficient"} and sum(used.values()) >= 2, used  # one per layer at least
        # no attention probabilities: nothing saved by a softmax over the keys
        assert not any(t.op in SOFTMAX and len(t.shape) == 4 for t in trace.tensors)
    assert "precision    bf16 autocast" in capsys.readouterr().out


def test_a_family_meta_cannot_step_is_profiled_on_the_cpu_and_says_so(tmp_path, capsys):
    """BART's forward reads a tensor's value (.item()); meta has none, so the CPU runs it, timed
    for the target."""
    _known("bart")
    out = tmp_path / "t.json"
    assert main(["profile", "hf:bart", "--device", "meta", "--hardware", "gh200-c2c", "--out", str(out)]) == 0
    assert "profiling it on the CPU instead" in capsys.readouterr().err
    trace = load_trace(out)
    assert trace.timing == "roofline" and trace.device == "gh200-c2c" and trace.meta["attention"]


@pytest.mark.parametrize(("args", "message"), [
    (["hf:no-such-family"], "has no model_type 'no-such-family'"),
    (["hf:llama", "--dtype", "bf16", "--hardware", "v100-pcie3"], "v100-pcie3 has no bfloat16 peak"),
    (["hf:llama", "--dtype", "fp32", "--attention", "flash"], "flash attention runs in fp16 or bf16"),
    (["hf:llama", "--attention", "mem-efficient", "--hardware", "cpu-emulated"], "no CPU kernel"),
    (["hf:llava"], "multimodal"),
    (["hf:wav2vec2"], "hf-wav2vec2-small"),  # SpecAugment draws from numpy: the two passes differ
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    if args[0] != "hf:no-such-family":
        _known(args[0][3:])
    assert main(["profile", *args, "--device", "meta", "--out", "/tmp/swapsched-test-never.json"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("swapsched profile: error")]
    assert len(err) == 1 and message in err[0], err


def _llama_layer_bytes(config, b: int, s: int) -> int:
    """A hand count of what one Llama decoder layer saves under bf16 autocast with flash attention
    (fp32 weights, so the residual stream is fp32), from the config alone:
    - each RMSNorm (2): its fp32 input, the fp32 product x * rsqrt, and the rsqrt per row;
    - five bf16 casts of a norm's output: the q, k and v projections' inputs, then gate's and up's;
    - flash: q and k (rotated, then cast to bf16), v, the output (which o_proj reads in place) and the
      fp32 log-sum-exp per head and row, with 16 + 8 bytes of RNG state;
    - the MLP: gate's output (SiLU's input), SiLU's output, up's output, their product (down's input),
      each b x s x intermediate in bf16.
    The rotary cos/sin tables are made once and shared by every layer."""
    h, f, heads, kv = config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads
    d = h // heads
    norms = 2 * (2 * 4 * b * s * h + 4 * b * s)
    casts = 5 * 2 * b * s * h
    flash = 2 * b * s * heads * d * 2 + 2 * b * s * kv * d + 2 * b * s * heads * d + 4 * b * heads * s + 16 + 8
    mlp = 4 * 2 * b * s * f
    return norms + casts + flash + mlp


def test_a_7b_llama_at_2k_with_flash_saves_no_attention_matrix_and_what_a_hand_count_says():
    case = build_model("hf:llama", "full", batch_size=1, seq_len=2048, device="meta")
    trace = profile(case.model, case.inputs, case.loss_fn, torch.optim.AdamW(case.model.parameters()), device="meta",
                    name=case.name, hardware="h100-pcie5", precision=Precision("bf16", amp=True), attention="auto")
    config = case.model.hf.config
    assert trace.meta["attention"] == {"flash": config.num_hidden_layers}
    assert not any(len(t.shape) == 4 and t.shape[-2:] == (2048, 2048) for t in trace.tensors)
    layers: dict[int, list] = defaultdict(list)
    for t in trace.tensors:
        parts = t.module.split(".")
        if "layers" in parts:
            layers[int(parts[parts.index("layers") + 1])].append(t)
    assert sorted(layers) == list(range(config.num_hidden_layers))
    hand = _llama_layer_bytes(config, 1, 2048)
    for i in range(1, config.num_hidden_layers):  # layer 0 also holds the shared rotary tables
        assert sum(t.bytes for t in layers[i]) == hand, i
    # the largest in the layers are bf16 (the MLP's b x s x intermediate); above them only the loss's
    # fp32 log-softmax over the vocabulary (transformers' loss upcasts the logits)
    in_layers = [t for ts in layers.values() for t in ts]
    top = max(in_layers, key=lambda t: t.bytes)
    assert top.dtype == "bfloat16" and top.bytes == 2 * 2048 * config.intermediate_size
    above = [t for t in trace.tensors if t.bytes > top.bytes]
    assert [(t.op, t.dtype, t.shape) for t in above] == [("_log_softmax", "float32", (2048, config.vocab_size))]
    # static: fp32 weights and two fp32 Adam states per parameter, and the buffers; the fp32
    # gradients count from their birth in backward (R3), all of them by the step's end
    n = sum(p.numel() for p in case.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in case.model.buffers())
    assert trace.static_bytes == 12 * n + buffers
    assert trace.gradients_born_so_far[-1] == 4 * n and trace.gradients_born_so_far[trace.backward_start - 1] == 0


def test_pure_bf16_and_eager_attention_change_what_is_saved(tmp_path):
    out = tmp_path / "t.json"
    assert main(["profile", "hf:llama", "--device", "meta", "--no-amp", "--attention", "eager", "--out", str(out)]) == 0
    trace = load_trace(out)
    assert trace.meta["param_dtype"] == "bfloat16" and trace.meta["attention"] == {}
    assert any(t.op in SOFTMAX and t.shape[-2:] == (64, 64) for t in trace.tensors)  # eager's probabilities
    model = build_model("hf:llama", device="meta", dtype=torch.bfloat16).model
    n = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert trace.static_bytes == 8 * n + buffers  # bf16 weights, gradients and Adam states
    data = json.loads(out.read_text())
    assert data["meta"]["attention_requested"] == "eager"


# --------------------------------------------------------------------- a config of the user's own

#: A Llama-3-shaped config at a size meta builds in a moment, every architecture field set apart
#: from its library default (grouped-query attention, an FFN width no rule derives, a vocabulary
#: of its own, tied embeddings)
_OWN = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 384, "intermediate_size": 1000,
        "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 5003,
        "max_position_embeddings": 4096, "rope_theta": 500000.0, "tie_word_embeddings": True, "bos_token_id": 1,
        "eos_token_id": 2}


def _llama_params(c: dict) -> int:
    """Llama's parameter count from its config: embeddings (once, tied), per layer q and o (h x h),
    k and v (h x kv heads x head dim), gate, up and down (h x ffn), two RMSNorm weights, and the
    final norm."""
    h, f, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    layer = 2 * h * h + 2 * h * kv * d + 3 * h * f + 2 * h
    head = 0 if c["tie_word_embeddings"] else c["vocab_size"] * h
    return c["vocab_size"] * h + c["num_hidden_layers"] * layer + h + head


def test_a_config_file_is_built_at_its_own_size_with_every_field(tmp_path):
    from swapsched.zoo import build_model

    _known("llama")
    path = tmp_path / "mine" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(_OWN))
    case = build_model(f"hf:{path}", device="meta", seq_len=32, batch_size=2)
    hf = case.model.hf
    cfg = hf.config
    assert case.name == "hf-mine"  # the folder's name
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (3, 384, 1000)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (6, 2, 5003)
    assert len(hf.model.layers) == 3
    attn = hf.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (2 * 64, 384) and attn.q_proj.weight.shape == (384, 384)
    assert hf.model.layers[0].mlp.up_proj.weight.shape == (1000, 384)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # tied
    assert sum(p.numel() for p in hf.parameters()) == _llama_params(_OWN)
    assert case.inputs[0].shape == (2, 32)
    # the folder names the file too; an override sets a field, untied embeddings add the head
    untied = build_model(f"hf:{path.parent}", device="meta", seq_len=8,
                         overrides={"num_hidden_layers": "5", "tie_word_embeddings": "false"})
    assert sum(p.numel() for p in untied.model.parameters()) == _llama_params(
        {**_OWN, "num_hidden_layers": 5, "tie_word_embeddings": False})


def test_the_published_llama3_8b_config_counts_its_parameters():
    from swapsched.zoo import build_model

    _known("llama")
    c = json.loads((Path(__file__).parent / "data" / "llama3-8b.json").read_text())
    case = build_model(f"hf:{Path(__file__).parent / 'data' / 'llama3-8b.json'}", device="meta", seq_len=8)
    n = sum(p.numel() for p in case.model.parameters())
    assert n == _llama_params(c) and round(n / 1e9, 2) == 8.03


@pytest.mark.parametrize(("make", "args", "message"), [
    (None, ["hf:{d}/missing.json"], "no such file"),
    ("{", ["hf:{d}/config.json"], "is not a JSON config"),
    ('{"hidden_size": 8}', ["hf:{d}/config.json"], "has no 'model_type' field"),
    ('{"model_type": "no-such-arch"}', ["hf:{d}/config.json"], "has no model_type 'no-such-arch'"),
    (json.dumps(_OWN), ["hf:{d}/config.json", "--override", "num_hiden_layers=2"], "has no field 'num_hiden_layers'"),
    (None, ["hf:{d}/config.json", "--override", "num_hidden_layers"], "give KEY=VALUE"),
    (None, ["gpt", "--override", "n_layer=2"], "is not a hf: model"),
])
def test_a_bad_config_is_one_line_and_exit_2(make, args, message, tmp_path, capsys):
    _known("llama")
    if make is not None:
        (tmp_path / "config.json").write_text(make)
    args = [a.replace("{d}", str(tmp_path)) for a in args]
    for command in (["profile", *args, "--device", "meta", "--out", str(tmp_path / "t.json")], ["fit", *args]):
        try:
            code = main(command)
        except SystemExit as exc:  # argparse's own refusal of a malformed argument
            code = exc.code
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2, lines
        assert len(lines) == 1 and message in lines[0] and lines[0].startswith(f"swapsched {command[0]}: error"), lines


def test_a_hub_name_without_network_is_one_line_and_exit_2():
    # a process of its own: huggingface_hub reads HF_HUB_OFFLINE as it is imported
    done = subprocess.run([sys.executable, "-m", "swapsched.cli", "fit", "hf:swapsched-test-org/no-such-model"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "cannot fetch its config.json" in lines[0], done.stderr
