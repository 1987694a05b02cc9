"""``swapsched fit``: a model at its real size, profiled on meta, and each way of fitting it on the
given hardware in one table (``swapsched/fit.py``)."""

from __future__ import annotations

import argparse
import json
import sys

from swapsched.errors import UserError

__all__ = ["cmd_fit"]


def cmd_fit(args: argparse.Namespace) -> int:
    from swapsched._paths import atomic_path
    from swapsched.cli.profile import profile_case
    from swapsched.fit import fit, fit_curves, format_fit
    from swapsched.hardware import load_hardware
    from swapsched.precision import Precision

    args.state = True  # the state is what may move
    world = args.world_size
    if args.model.startswith("hf:"):  # a fine-tune's step: one sequence of 4k tokens unless told
        args.seq_len = args.seq_len or 4096
        args.batch_size = args.batch_size or 1
    if args.disk_budget is not None and (world > 1 or args.host_memory is None):
        raise UserError("--disk-budget holds what --host-memory cannot, on one device: give --host-memory, without "
                        "--world-size")
    hws = [load_hardware(h).with_host(disk_budget_bytes=args.disk_budget) for h in args.hardware]  # drives' rates checked
    # R18: a rank computes as FSDP2's MixedPrecisionPolicy runs it (no autocast copies)
    # R13: a LoRA base is frozen in --dtype (no fp32 master to keep); its adapters are fp32 (PEFT's)
    precision = Precision(args.dtype, amp=args.amp and world == 1 and not args.lora_rank)
    for hw in hws:
        hw.peak_flops_for(precision.compute_dtype)  # a dtype the hardware lacks: one line, before any work
    talk = not args.no_progress and sys.stderr.isatty()
    if talk:
        print(f"profiling {args.model} on meta...", end="\r", file=sys.stderr, flush=True)
    trace, case = profile_case(args, "meta", precision, "auto", hws[0].name)
    if world > 1:
        from swapsched.sharding import shard_trace

        trace = shard_trace(trace, world, gather_bytes=precision.param_dtype.itemsize)
    ids = case.inputs[0] if case.inputs else None
    # a token model's first input is its ids (batch x sequence); anything else counts samples
    if ids is not None and not ids.dtype.is_floating_point and ids.dim() >= 2:
        tokens, unit = ids.numel(), "tokens"
    else:
        tokens, unit = (int(ids.shape[0]) if ids is not None and ids.dim() else 1), "samples"
    report = fit(trace, hws, tokens, unit, host_memory=args.host_memory, disk=args.disk_budget, progress=not args.no_progress)
    print(format_fit(report))
    if args.json:
        with atomic_path(args.json) as tmp:
            tmp.write_text(json.dumps(report.to_dict(), indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        from swapsched.plots import plot_fit

        hw = hws[0].with_host(host_budget_bytes=args.host_memory, disk_budget_bytes=args.disk_budget)
        curves = fit_curves(trace, hw, progress=not args.no_progress)
        plot_fit(curves, hws[0].device_memory_bytes, args.plot, title=f"{trace.name} on {hws[0].name}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
