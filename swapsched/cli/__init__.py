"""The ``swapsched`` command. Every sub-command has ``--help``; bad input exits 2 with one line.

This module holds the parser and ``main``; ``commands.py`` the commands after
``profile``/``inspect`` (``profile.py``); ``arguments.py`` the argument types that check each
value where it is given."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from swapsched.cli.arguments import (
    Parser,
    budget,
    budgets,
    csv_list,
    disk_budget,
    host_budget,
    in_dir,
    in_file,
    out_dir,
    out_file,
    override,
    policy_list,
    positive_float,
    positive_int,
    ranks,
)
from swapsched.cli.commands import (
    cmd_calibrate,
    cmd_compare,
    cmd_plan,
    cmd_run,
    cmd_simulate,
    cmd_train_policy,
    default_train_config,
)
from swapsched.cli.fit import cmd_fit
from swapsched.cli.profile import cmd_inspect, cmd_profile
from swapsched.errors import UserError
from swapsched.hardware import DEFAULT_GPU_HARDWARE, EXECUTORS

__all__ = ["main"]


#: What ``compare`` runs by default: the single-pass heuristics and the shipped planner (under 1 s a case).
FAST_POLICIES = ("swap-all", "vdnn-all", "min", "capuchin", "checkpoint-all", "checkpoint-selective", "default")


# ----------------------------------------------------------------------------- the parser


def _add_execution(sp: argparse.ArgumentParser) -> None:
    """The options that say how a plan is executed: who runs it (R10) and the host's room (R11)."""
    sp.add_argument("--executor", choices=EXECUTORS, default="hooks",
                    help="who executes the plan (R10): hooks (SwapRuntime, its host costs, two copy streams) or "
                         "compiled (CompileBackend: no hook costs, one transfer stream); default hooks")
    sp.add_argument("--host-budget", type=host_budget, metavar="BYTES",
                    help="host memory this rank's swapped tensors may hold at once, like '64GiB' (R11; default unlimited)")
    sp.add_argument("--disk-budget", type=disk_budget, metavar="BYTES",
                    help="turn the disk tier on (R19): the state this rank may rest on the NVMe drive the --hardware "
                         "profile describes, like '1TiB', where the host budget cannot hold it (default: no disk)")


#: --lora-rank of profile and fit (R13, frozen groups)
LORA_HELP = ("LoRA adapters of rank R on every linear layer (HF PEFT, target_modules='all-linear'): the base "
             "frozen in --dtype (its weights movable like the rest of the state), the adapters and their AdamW "
             "state in fp32")


def build_parser() -> argparse.ArgumentParser:
    from swapsched import __version__

    p = Parser(prog="swapsched", description="Learned and heuristic activation-swap scheduling for PyTorch training.")
    p.add_argument("--version", action="version", version=f"swapsched {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    sp = add("profile", cmd_profile, "Profile one training step of a zoo model into a trace.")
    sp.add_argument("model", help="zoo family (mlp, vgg, resnet, gpt, bert, unet), hf:MODEL_TYPE, hf:PATH/config.json, "
                    "hf:ORG/NAME (its config only), or package.module:function")
    sp.add_argument("--size", help="size from configs/models/FAMILY.yaml (default: small; a hf: config of your own: "
                    "as it is)")
    sp.add_argument("--batch-size", type=positive_int, help="batch size (default: the size's own)")
    sp.add_argument("--seq-len", type=positive_int, help="sequence length (gpt, bert, hf:)")
    sp.add_argument("--device", choices=["cpu", "cuda", "meta"], default="cpu",
                    help="meta: no memory, no data; roofline timing for --hardware (default h100-pcie5)")
    sp.add_argument("--hardware", help="retime by roofline for this hardware (name or YAML path)")
    sp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                    help="what the step computes in (default: bf16 when profiling for a GPU, i.e. --device meta or "
                         "cuda or a --hardware; fp32 for the CPU's own step)")
    sp.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True,
                    help="autocast to --dtype over fp32 weights, grads and Adam states (default); --no-amp: "
                         "parameters and optimizer state in --dtype too")
    sp.add_argument("--attention", choices=["auto", "flash", "mem-efficient", "math", "eager"],
                    help="the attention kernel (default, profiling for a GPU: auto, what SDPA picks on --hardware for "
                         "these shapes, flash where it can; for the CPU's own step: SDPA as it runs there); eager: a hf: "
                         "model's own attention code")
    sp.add_argument("--optimizer", choices=["adamw", "sgd", "adafactor", "none"], default="adamw",
                    help="whose state the trace counts (default adamw: 2 states per parameter, in its dtype)")
    sp.add_argument("--state", action=argparse.BooleanOptionalAction, default=True,
                    help="record parameters, gradients and optimizer state per group, movable by a plan (default); "
                         "--no-state: all of it static, as traces of format 1")
    sp.add_argument("--override", type=override, action="append", metavar="KEY=VALUE",
                    help="set a hf: model's config field, e.g. num_hidden_layers=4 (repeatable)")
    sp.add_argument("--world-size", type=positive_int, default=1, metavar="N",
                    help="one rank of N under FSDP2 (R18): the state sharded per unit, each unit's all-gather and "
                         "reduce-scatter recorded, the compute on bf16 unsharded parameters (default 1: one device)")
    sp.add_argument("--lora-rank", type=positive_int, metavar="R", help=LORA_HELP)
    sp.add_argument("--out", type=out_file, help="output trace (.json or .json.gz; default MODEL-SIZE.json.gz)")

    sp = add("fit", cmd_fit, "Will a model's training step fit this hardware, and how fast? One table: plain, every block "
             "checkpointed, the state offloaders and default, each simulated at the model's real size (profiled on meta).")
    sp.add_argument("model", help="hf:PATH/config.json, hf:ORG/NAME (its config only), hf:MODEL_TYPE, a zoo family, "
                    "or package.module:function")
    sp.add_argument("--size", help="hf: configs: as given (default); zoo families: a size from configs/models/FAMILY.yaml")
    sp.add_argument("--override", type=override, action="append", metavar="KEY=VALUE",
                    help="set a hf: model's config field, e.g. num_hidden_layers=40 (repeatable)")
    sp.add_argument("--hardware", type=csv_list, default=[DEFAULT_GPU_HARDWARE],
                    help=f"comma list of names or YAML paths, a table row per option on each (default {DEFAULT_GPU_HARDWARE})")
    sp.add_argument("--host-memory", type=host_budget, metavar="BYTES",
                    help="host memory for the state and swapped activations, like 64GiB; a node's with --world-size "
                         "(default: unlimited)")
    sp.add_argument("--disk-budget", type=disk_budget, metavar="BYTES",
                    help="with --host-memory, one device: what the state may rest on the hardware profile's NVMe drives, "
                         "like 1TiB (R19), and a zero-infinity row (default: no disk)")
    sp.add_argument("--world-size", type=positive_int, default=1, metavar="N",
                    help="N ranks under FSDP2 (R18): one rank's step planned, the job's tokens a second (default 1)")
    sp.add_argument("--lora-rank", type=positive_int, metavar="R", help=LORA_HELP)
    sp.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (hf: default 4096)")
    sp.add_argument("--batch-size", type=positive_int, default=None, help="sequences per step (hf: default 1)")
    sp.add_argument("--optimizer", choices=["adamw", "sgd", "adafactor"], default="adamw", help="default adamw")
    sp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="what the step computes in (default bf16)")
    sp.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True,
                    help="autocast over fp32 weights, grads and optimizer state (default); --no-amp: all in --dtype")
    sp.add_argument("--json", metavar="OUT", type=out_file, help="write the table as JSON")
    sp.add_argument("--plot", metavar="PNG", type=out_file, help="step against device memory for each option (first hardware)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")

    sp = add("inspect", cmd_inspect, "Summarize a trace.")
    sp.add_argument("trace")
    sp.add_argument("--json", action="store_true", help="print JSON")

    sp = add("simulate", cmd_simulate, "Simulate a plan on a trace (rules R1-R8).")
    sp.add_argument("--trace", required=True, help="trace file (.json or .json.gz)")
    sp.add_argument("--plan", required=True, help="plan file written by swapsched plan")
    sp.add_argument("--hardware", required=True, help="name (configs/hardware) or YAML path")
    sp.add_argument("--budget", type=budget, required=True, help="'6GiB', '6e9' or '60%%' of the activation peak")
    sp.add_argument("--json", metavar="OUT", type=out_file, help="write the result as JSON")
    sp.add_argument("--plot", metavar="PNG", type=out_file, help="draw memory over time and the three streams")
    _add_execution(sp)

    sp = add("plan", cmd_plan, "Make a plan with a policy and write it as JSON.")
    sp.add_argument("--trace", required=True, help="trace file (.json or .json.gz)")
    sp.add_argument("--policy", required=True, help="registry name (see compare --help) or a checkpoint .zip")
    sp.add_argument("--hardware", required=True, help="name (configs/hardware) or YAML path")
    sp.add_argument("--budget", type=budget, required=True, help="'6GiB', '6e9' or '60%%' of the activation peak")
    sp.add_argument("--out", required=True, type=out_file, help="plan file to write (JSON)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the randomized policies (default 0)")
    sp.add_argument("--search-seconds", type=positive_float, default=10.0, help="time box of swapadvisor")
    _add_execution(sp)

    sp = add("compare", cmd_compare, "Compare policies on traces x budgets x hardware in one table.")
    sp.add_argument("--traces", nargs="+", metavar="T", help="trace files (default: the shipped corpus of zoo models, train and test splits)")
    sp.add_argument("--budgets", type=budgets, default=["30%", "50%", "70%"], help="comma list (default 30%%,50%%,70%%)")
    sp.add_argument("--hardware", type=csv_list, default=[DEFAULT_GPU_HARDWARE],
                    help=f"comma list of names or YAML paths (default {DEFAULT_GPU_HARDWARE})")
    _add_execution(sp)
    sp.add_argument("--ranks-per-host", type=ranks, default=[1], metavar="N[,N...]",
                    help="ranks sharing the host's memory bandwidth (R11: FSDP/DDP ranks on one node), a row per value; default 1")
    sp.add_argument("--policies", default=",".join(FAST_POLICIES),
                    help="'all' or a comma list of: no-swap, swap-all, vdnn-all, vdnn-conv, min, capuchin, capuchin-swap, "
                         "checkpoint-all, checkpoint-selective, local-search, swapadvisor, optimal, optimal:SECONDSs, "
                         "default, default-swap, default-greedy, default-ppo, learned:PATH.zip, "
                         f"learned-greedy:PATH.zip, learned-ppo:PATH.zip (default: {','.join(FAST_POLICIES)}; the searches "
                         "local-search, swapadvisor and optimal take 1-60 s per case)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the randomized policies (default 0)")
    sp.add_argument("--search-seconds", type=positive_float, default=2.0, help="time box of swapadvisor per case")
    sp.add_argument("--json", metavar="OUT", type=out_file, help="write every row and the summary as JSON")
    sp.add_argument("--plot", metavar="PNG", type=out_file, help="heat map of each policy's step over the R8 floor per budget (+ PNG-timeline for the first case)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")

    sp = add("run", cmd_run, "Train a zoo model with the live runtime; --compare runs every policy and PyTorch's peers.")
    sp.add_argument("model", help="zoo family, hf:MODEL_TYPE, or package.module:function")
    sp.add_argument("--size", help="size from configs/models/FAMILY.yaml (default: small)")
    sp.add_argument("--batch-size", type=positive_int, help="batch size (default: the size's own)")
    sp.add_argument("--seq-len", type=positive_int, help="sequence length (gpt, bert, hf:)")
    sp.add_argument("--budget", type=budget, default="50%", help="'60%%' of the activation peak, or bytes like '6GiB' (default 50%%)")
    sp.add_argument("--policy", default="default", help="registry name or checkpoint .zip (default: the learned policy)")
    sp.add_argument("--steps", type=positive_int, default=10, help="training steps, the first 3 are profiled (default 10)")
    sp.add_argument("--backend", choices=["cpu", "cuda"], help="default: cuda when available")
    sp.add_argument("--bandwidth", type=positive_float, help="CPU backend: throttle both copy engines to this many bytes/s")
    sp.add_argument("--hardware", help="profile the plan is made for (default: cpu-emulated on cpu, h100-pcie5 on cuda)")
    sp.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                    help="sgd (no state, default) or adamw; with adamw a byte budget below what the activations alone "
                         "can meet moves parameters, gradients and optimizer state (and --compare adds the offloaders' placements)")
    sp.add_argument("--compare", action="store_true",
                    help="also run the other policies and the peers (plain, checkpointing, selective checkpointing, "
                         "save_on_cpu, checkpoint-offload) in shuffled interleaved rounds, each with its measured peak")
    sp.add_argument("--rounds", type=positive_int, default=6, help="with --compare: interleaved rounds (default 6, at least 2)")
    sp.add_argument("--round-steps", type=positive_int, default=2, help="with --compare: steps per method per round (default 2)")
    sp.add_argument("--compare-policies", type=policy_list, help="with --compare: which other policies (default: all but optimal, swapadvisor)")
    sp.add_argument("--json", metavar="OUT", type=out_file, help="write one record per method as JSON")
    sp.add_argument("--plot", metavar="PNG", type=out_file, help="step time and peak memory per method")
    sp.add_argument("--no-progress", action="store_true", help="no per-step lines")
    sp.add_argument("--host-budget", type=host_budget, metavar="BYTES",
                    help="with --optimizer adamw: the host memory the runtime's state and swapped tensors may hold, like "
                         "'2GiB' (R11; default unlimited)")
    sp.add_argument("--disk", type=in_dir, metavar="DIR",
                    help="with --host-budget: a directory on a local drive where plans rest the optimizer state the host "
                         "budget cannot hold (R19); --compare adds zero-infinity")
    sp.add_argument("--disk-budget", type=disk_budget, metavar="BYTES",
                    help="with --disk: what the state may rest there, like '100GiB' (default nine tenths of its free space)")
    sp.add_argument("--world-size", type=positive_int, default=1, metavar="N",
                    help="N gloo ranks of this machine under FSDP2 (R18), with AdamW: the model wrapped by "
                         "swapsched.fully_shard and trained under the runtime; --compare adds fsdp, fsdp-offload and "
                         "fsdp-partial, carried out by FSDP2; --budget is a rank's (bytes, or a share of its static "
                         "bytes); --rounds x --round-steps timed steps after 6 warm-up steps (default 1)")

    sp = add("calibrate", cmd_calibrate, "Measure this machine's link and the runtime's host costs into a hardware YAML for the simulator.")
    sp.add_argument("--backend", choices=["cpu", "cuda"], default="cpu", help="backend whose copies are measured (default cpu)")
    sp.add_argument("--bandwidth", type=positive_float, help="CPU backend: measure the engines throttled to this many bytes/s")
    sp.add_argument("--name", help="profile name (default calibrated-BACKEND)")
    sp.add_argument("--world-size", type=positive_int, default=1, metavar="N",
                    help="also time all-gathers over N ranks started on this machine (gloo on cpu, NCCL on cuda), "
                         "for sharded steps (R18); default 1: no collectives")
    sp.add_argument("--disk", type=in_dir, metavar="DIR",
                    help="also measure the drive under DIR (R19): direct-I/O reads and writes of 1 GiB in 16 MiB "
                         "requests and one block's latency, for the disk tier (about a second on an NVMe drive)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.add_argument("--out", default="calibrated.yaml", type=out_file, help="hardware YAML to write (default calibrated.yaml)")

    sp = add("train-policy", cmd_train_policy, "Train a swap policy (MaskablePPO on SwapEnv) and evaluate it on held-out traces.")
    sp.add_argument("--config", default=str(default_train_config()), help="PPO settings YAML (default: configs/train/default.yaml)")
    sp.add_argument("--out", default="checkpoints/mine.zip", type=out_file, help="checkpoint path; NAME.json is written beside it")
    sp.add_argument("--timesteps", type=positive_int, help="override the config's total_timesteps (with --resume: steps to add); PPO runs whole rollouts "
                    "(n_steps x n_envs), so it rounds up to the next multiple and says so")
    sp.add_argument("--seed", type=int, help="override the config's seed (training is deterministic for a seed with --n-envs 1)")
    sp.add_argument("--n-envs", type=positive_int, help="override the config's n_envs (more than 1: subprocess environments)")
    sp.add_argument("--resume", metavar="CKPT", type=in_file, help="continue this checkpoint: its step count, optimizer state and schedule")
    sp.add_argument("--tensorboard", metavar="DIR", type=out_dir, help="write learning curves and the validation ratio to min here")
    sp.add_argument("--quick", action="store_true",
                    help="a short run, a couple of minutes end to end: --timesteps 2048 with the search parts scaled down alike "
                         "(any --timesteps below the config's scales them the same way)")
    sp.add_argument("--search-only", action="store_true",
                    help="only (re)learn the search's move prior, plan editor and block chooser for the existing checkpoint --out")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: partial files are removed, checkpoints saved


def main(argv: Sequence[str] | None = None) -> int:
    import signal
    import threading

    parser = build_parser()
    args = parser.parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return args.fn(args)
    except UserError as exc:
        print(f"swapsched {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)

