#!/usr/bin/env python
"""Build the shipped trace corpus: python scripts/build_traces.py [--out swapsched/env/traces] [--only zoo|generated] [--precision fp32|autocast]

Every zoo family at three sizes is profiled on this machine's CPU (``timing: measured``), and the
same models plus a few large ones are profiled on the ``meta`` device with roofline timing for a
GPU (``timing: roofline``): the CPU traces teach the policy real measured gap structure, the
roofline ones GPU-like ratios of compute to copy time. The U-Net family and the largest models are
held out (``split: test``) so that evaluation covers architectures the policy never trained on.

The ``generated`` split is ``GENERATED`` random architectures (``swapsched/generated.py``), each
profiled on meta with roofline timing for one of the training GPUs in turn: the far wider set the
search's learned parts (move prior, plan editor, block chooser) train on beside the zoo's train
split. ``--only`` rebuilds one part and ``--precision`` one precision; the index keeps the rows of
what is not rebuilt.

Every roofline trace, zoo and generated, is built twice: in fp32 and in bf16 autocast over fp32
weights (``Precision("bf16", amp=True)``, what ``swapsched profile`` does for a GPU by default),
named ``...-bf16``, in the same split (fp16 autocast, ``...-fp16``, on a GPU with no bf16 unit: a V100). bf16 halves what autograd saves of the matmuls' inputs,
keeps the norms' and softmaxes' in fp32, and runs the matmuls at the bf16 peak: other ratios of
bytes to compute, which the learned parts must see to plan for the precision users run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from swapsched.generated import describe, random_architecture
from swapsched.hardware import load_hardware
from swapsched.jsonfile import write_json
from swapsched.precision import Precision
from swapsched.runtime.profiler import profile
from swapsched.trace_file import save_trace
from swapsched.zoo import build_model

MEASURED = [(f, s) for f in ("mlp", "vgg", "resnet", "gpt", "bert", "unet") for s in ("tiny", "small", "medium")]
# (family, size, batch size, sequence length, target hardware): batches large enough that a GPU
# step takes milliseconds, as in real training, so compute and copy times have realistic ratios.
ROOFLINE = [
    ("mlp", "large", 8192, None, "h100-pcie5"), ("mlp", "medium", 16384, None, "a100-pcie4"),
    ("vgg", "medium", 256, None, "h100-pcie5"), ("vgg", "large", 64, None, "v100-pcie3"),
    ("resnet", "medium", 256, None, "h100-pcie5"), ("resnet", "large", 64, None, "a100-pcie4"),
    ("resnet", "large", 128, None, "rtx4090-pcie4"),
    ("gpt", "medium", 64, 512, "h100-pcie5"), ("gpt", "large", 32, 256, "rtx4090-pcie4"),
    ("gpt", "350m", 8, 1024, "h100-pcie5"), ("gpt", "350m", 16, 1024, "a100-pcie4"),
    ("bert", "medium", 64, 512, "a100-pcie4"), ("bert", "base", 16, 512, "h100-pcie5"),
    ("unet", "medium", 64, None, "h100-pcie5"), ("unet", "large", 16, None, "a100-pcie4"),
    ("gpt", "1.3b", 8, 1024, "h200-pcie5"), ("gpt", "1.3b", 4, 2048, "gh200-c2c"),
]
HELD_OUT_FAMILIES = {"unet"}
HELD_OUT_SIZES = {("gpt", "1.3b"), ("bert", "base")}  # larger than anything trained on
GENERATED = 32
GENERATED_HARDWARE = ("a100-pcie4", "h100-pcie5", "rtx4090-pcie4", "v100-pcie3")
#: the precisions every roofline trace is built in: None (as the model is: fp32) and bf16 autocast
ROOFLINE_PRECISIONS = (None, "bf16")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "swapsched" / "env" / "traces"))
    ap.add_argument("--only", choices=["zoo", "generated"], help="rebuild only this part; keep the other's index rows")
    ap.add_argument("--precision", choices=["fp32", "autocast"],
                    help="rebuild only the traces of this precision (autocast: bf16, or fp16 on a GPU without bf16); "
                         "keep the other rows of the index")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    jobs: list[tuple] = []
    if args.only != "generated":
        jobs += [(f, s, None, None, "cpu", None, None) for f, s in MEASURED]
        jobs += [(f, s, b, t, "meta", hw, None) for f, s, b, t, hw in ROOFLINE]
        jobs += [(f, s, b, t, "meta", hw, "bf16") for f, s, b, t, hw in ROOFLINE]
    if args.only != "zoo":
        jobs += [("generated", seed, None, None, "meta", GENERATED_HARDWARE[seed % len(GENERATED_HARDWARE)], dtype)
                 for dtype in ROOFLINE_PRECISIONS for seed in range(GENERATED)]
    if args.precision:
        jobs = [j for j in jobs if (j[-1] is None) == (args.precision == "fp32")]
    # a partial rebuild replaces its own rows of the index, in place, and keeps the others
    index = json.loads((out / "index.json").read_text())["traces"] if (args.only or args.precision) and \
        (out / "index.json").is_file() else []
    row_of = {r["file"]: i for i, r in enumerate(index)}
    for family, size, batch, seq, device, hw, dtype in tqdm(jobs, desc="profiling", unit="model"):
        if family == "generated":
            case, name, split = random_architecture(size), f"generated-{size}-{hw}", "generated"
        else:
            case = build_model(family, size, batch_size=batch, seq_len=seq, device=device)
            name = f"{family}-{size}-cpu" if device == "cpu" else f"{family}-{size}-b{batch}-{hw}"
            split = "test" if family in HELD_OUT_FAMILIES or (family, size) in HELD_OUT_SIZES else "train"
        if dtype and load_hardware(hw).bf16_peak_flops is None:
            dtype = "fp16"  # what that GPU's users autocast to
        precision = Precision(dtype, amp=True) if dtype else None
        name += f"-{dtype}" if dtype else ""
        trace = profile(case.model, case.inputs, case.loss_fn, device=device, name=name, hardware=hw, precision=precision)
        file = f"{name}.json.gz"
        save_trace(trace, out / file)
        row = {"file": file, "name": name, "family": family, "size": size, "batch_size": batch, "timing": trace.timing,
               "device": trace.device, "tensors": trace.n_tensors, "events": trace.n_events, "split": split,
               "precision": dtype or "fp32"}
        if family == "generated":
            row.update(size=str(size), architecture=describe(size))
        if file in row_of:
            index[row_of[file]] = row
        else:
            index.append(row)
    write_json({"traces": index}, out / "index.json", indent=1)
    total = sum((out / r["file"]).stat().st_size for r in index)
    print(f"{len(index)} traces, {total / 1e6:.2f} MB in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
