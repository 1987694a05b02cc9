"""``swapsched profile`` and ``swapsched inspect``: a model's training step into a Trace, and a
trace's summary."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from swapsched.errors import UserError

if TYPE_CHECKING:
    from swapsched.trace import Trace

__all__ = ["cmd_profile", "cmd_inspect", "print_summary", "profile_case", "say_if_shrunk", "summary", "trace_summary"]


def trace_summary(trace: Trace) -> dict[str, Any]:
    """The numbers ``swapsched inspect`` prints."""
    return {
        "name": trace.name,
        "tensors": trace.n_tensors,
        "events": trace.n_events,
        "saved_bytes_peak": trace.saved_bytes_peak,
        "static_bytes": int(trace.static_bytes),
        "state_bytes": int(trace.static_bytes - trace.fixed_bytes),
        "state_groups": len(trace.state),
        "param_bytes": sum(g.param_bytes for g in trace.state),
        "grad_bytes": sum(g.grad_bytes for g in trace.state),
        "optim_bytes": sum(g.optim_bytes for g in trace.state),
        "min_feasible_bytes_movable": trace.min_feasible_bytes_movable,
        "peak_bytes_no_swap": trace.peak_bytes_no_swap,
        "min_feasible_bytes": trace.min_feasible_bytes,
        "compute_s": {"forward": trace.forward_compute_s, "backward": trace.backward_compute_s, "total": trace.ideal_s},
        "timing": trace.timing,
        "device": trace.device,
        "world_size": trace.world_size,
    }


def say_if_shrunk(model: str, size: str | None) -> None:
    """hf: model types are built small unless asked for the library's full configuration: say so
    (a config of the user's own is built as it is)."""
    from swapsched.hf_models import is_config_source

    if model.startswith("hf:") and (size == "small" or size is None and not is_config_source(model[3:])):
        print(f"{model}: built small (2 layers, width 128, vocabulary 1024); --size full builds the library's "
              "default configuration", file=sys.stderr)


def cmd_profile(args: argparse.Namespace) -> int:
    from swapsched.hardware import DEFAULT_CPU_HARDWARE, DEFAULT_GPU_HARDWARE, load_hardware
    from swapsched.precision import Precision
    from swapsched.trace_file import save_trace

    say_if_shrunk(args.model, args.size)
    device = args.device
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device is available here; use --device cpu or meta")
    for_gpu = device != "cpu" or args.hardware is not None
    world = args.world_size
    if world > 1 and not args.state:
        raise UserError("--world-size shards the state per group: it needs the state recorded (leave out --no-state)")
    # R18: a rank computes as FSDP2's MixedPrecisionPolicy runs it, on unsharded parameters of
    # the compute dtype (no autocast copies); its fp32 shards are counted by shard_trace
    # R13: a LoRA base is frozen in --dtype (no fp32 master to keep); its adapters are fp32 (PEFT's)
    precision = Precision(args.dtype or ("bf16" if for_gpu else "fp32"), amp=args.amp and world == 1 and not args.lora_rank)
    target = load_hardware(args.hardware or (DEFAULT_GPU_HARDWARE if for_gpu else DEFAULT_CPU_HARDWARE))
    target.peak_flops_for(precision.compute_dtype)  # a dtype the hardware lacks: one line, before any work
    # the CPU's own measured step runs SDPA as it is; for a GPU, as the GPU's kernel would
    attention = args.attention or ("auto" if for_gpu else None)
    trace, _ = profile_case(args, device, precision, attention, target.name if for_gpu else None)
    if world > 1:
        from swapsched.sharding import shard_trace

        trace = shard_trace(trace, world, gather_bytes=precision.param_dtype.itemsize)
    out = args.out or f"{trace.name}.json.gz"
    save_trace(trace, out)
    print_summary(summary(trace))
    print(f"precision    {precision} (compute {precision.compute_dtype}); attention {_kernels_used(trace.meta)}")
    if world > 1:
        print(f"sharded      one rank of {world}: fp32 shards of the state, parameters all-gathered in "
              f"{precision.param_dtype} (FSDP2's MixedPrecisionPolicy), gradients reduce-scattered in fp32")
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _kernels_used(meta: dict[str, Any]) -> str:
    used = meta.get("attention")
    if used is None:
        return "as SDPA ran on the profiling device"
    return ", ".join(f"{k} x{n}" for k, n in used.items()) or "the model's own (no SDPA call)"


#: What a forward says when it reads a tensor's values, which the meta device has none of
_READS_VALUES = ("cannot be called on meta tensors", "Cannot copy out of meta tensor", "data-dependent")


def profile_case(args: argparse.Namespace, device: str, precision: Any, attention: str | None,
                 target: str | None) -> tuple[Any, Any]:
    """Build and profile the case: ``(trace, case)``. An ``hf:`` model whose forward reads tensor values (which meta
    cannot run) is profiled on the CPU instead where its size fits there, timed by roofline for the
    target; any other failure of a ``hf:`` model's step is one line (exit 2)."""
    import torch

    from swapsched.hf_models import one_line
    from swapsched.runtime.profiler import profile
    from swapsched.zoo import build_model

    def run_on(dev: str) -> Any:
        case = build_model(args.model, args.size, batch_size=args.batch_size, seq_len=args.seq_len, device=dev,
                           dtype=precision.param_dtype, attention=attention, overrides=dict(args.override or ()))
        if getattr(args, "lora_rank", None):
            case = with_lora(case, args.lora_rank)
        optimizer = None if args.state else _optimizer(args.optimizer, case.model)
        return profile(case.model, case.inputs, case.loss_fn, optimizer, device=dev, name=case.name, hardware=target,
                       precision=precision, attention=attention, state=args.optimizer if args.state else None), case

    if not args.model.startswith("hf:"):
        return run_on(device)
    try:
        return run_on(device)
    except UserError:
        raise
    except Exception as exc:
        if device == "meta" and any(m in str(exc) for m in _READS_VALUES) and args.size in (None, "small") and target:
            print(f"{args.model}: its forward reads tensor values, which the meta device has none of; profiling "
                  "it on the CPU instead (timed by roofline for the target)", file=sys.stderr)
            torch.manual_seed(0)
            try:
                return run_on("cpu")
            except UserError:
                raise
            except Exception as exc2:
                exc = exc2
        raise UserError(f"{args.model}: its training step fails on {device}: {one_line(exc)}") from None


def with_lora(case: Any, rank: int) -> Any:
    """``case`` with its model wrapped by HF PEFT's LoRA of ``rank`` on every linear layer: the
    base frozen as built, the adapters in fp32 (PEFT's default); the state then holds frozen
    groups (R13)."""
    from dataclasses import replace

    try:
        import peft
    except ImportError:
        raise UserError("--lora-rank needs peft: pip install 'swapsched[hf]'") from None
    model = peft.get_peft_model(case.model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                            target_modules="all-linear"))
    return replace(case, model=model, name=f"{case.name}-lora{rank}")


def _optimizer(name: str, model: Any) -> Any:
    """The optimizer whose state the trace's static bytes count (state in the parameters' dtype)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if name == "none" or not params:
        return None
    return torch.optim.AdamW(params) if name == "adamw" else torch.optim.SGD(params, lr=0.1, momentum=0.9)


def summary(trace: Any) -> dict[str, Any]:
    """``trace_summary(trace)`` and, for a trace with its state, the least host memory the state needs
    with a disk (R19): every group off the device with its master and optimizer state on the disk,
    the host holding the gradients and the staging buffers."""
    from swapsched.env.state_parts import state_split

    s = trace_summary(trace)
    if trace.state:
        tiers = {g.name: "state" for g in trace.state}
        s["host_bytes_with_disk"] = state_split(trace.state, dict.fromkeys(tiers, "full"), tiers)[1]
    return s


def print_summary(s: dict[str, Any]) -> None:
    from swapsched.budget import format_bytes

    c = s["compute_s"]
    print(f"trace        {s['name']}  ({s['timing']} on {s['device']})"
          + (f"  one rank of {s['world_size']}: every figure is per rank" if s.get("world_size", 1) > 1 else ""))
    print(f"tensors      {s['tensors']}   events {s['events']}")
    print(f"saved peak   {format_bytes(s['saved_bytes_peak'])}  (nothing evicted)")
    print(f"static       {format_bytes(s['static_bytes'])}  (params, grads, optimizer state)")
    if s.get("state_bytes"):
        print(f"state        {format_bytes(s['state_bytes'])} of it movable in {s['state_groups']} groups "
              f"(parameters {format_bytes(s['param_bytes'])}, gradients {format_bytes(s['grad_bytes'])}, "
              f"optimizer {format_bytes(s['optim_bytes'])})")
    print(f"device peak  {format_bytes(s['peak_bytes_no_swap'])}  (no swap; 100%)   smallest feasible {format_bytes(s['min_feasible_bytes'])}"
          + ("  (the state kept)" if s.get("state_bytes") else ""))
    if s.get("state_bytes"):
        print(f"             smallest feasible with the state movable {format_bytes(s['min_feasible_bytes_movable'])}, "
              f"with {format_bytes(s['state_bytes'])} of host memory, or {format_bytes(s['host_bytes_with_disk'])} with "
              "a disk (--disk-budget: the gradients and the staging buffers)")
    print(f"compute      forward {1e3 * c['forward']:.3f} ms   backward {1e3 * c['backward']:.3f} ms   step {1e3 * c['total']:.3f} ms")


def cmd_inspect(args: argparse.Namespace) -> int:
    from swapsched.trace_file import load_trace

    s = summary(load_trace(args.trace))
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        print_summary(s)
    return 0
