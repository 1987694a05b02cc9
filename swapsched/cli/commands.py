"""The commands after ``profile``/``inspect`` (``profile.py``): ``simulate``, ``plan``,
``compare``, ``run``, ``calibrate`` and ``train-policy``; the parser and ``main`` are in
``__init__.py``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from swapsched.cli.profile import say_if_shrunk
from swapsched.errors import UserError

__all__ = ["cmd_simulate", "cmd_plan", "cmd_compare", "cmd_run", "cmd_calibrate", "cmd_train_policy",
           "default_train_config"]


def _simulated_on(trace: Any, hw: Any) -> str:
    """Where a plot's simulation runs: a trace measured on the CPU keeps its CPU compute times
    and borrows only the profile's links, and the title says so."""
    if trace.timing == "measured" and not str(trace.device).startswith("cuda"):
        return f"simulated with {hw.name}'s links (compute as measured on {trace.device})"
    return f"simulated on {hw.name}"


def _write_json(data: Any, path: str) -> None:
    from swapsched.jsonfile import write_json

    p = write_json(data, path, indent=2)
    print(f"wrote {p}", file=sys.stderr)


# ----------------------------------------------------------------------------- simulate / plan


def _load_case(trace_path: str, hardware: str, budget: str, executor: str = "hooks",
               host_budget: int | None = None, disk_budget: int | None = None) -> tuple[Any, Any, int]:
    from swapsched.budget import parse_budget
    from swapsched.hardware import load_hardware
    from swapsched.trace_file import load_trace

    trace = load_trace(trace_path)
    hw = load_hardware(hardware).for_executor(executor).with_host(host_budget_bytes=host_budget, disk_budget_bytes=disk_budget)
    return trace, hw, parse_budget(budget, trace)


def _print_result(r: dict[str, Any]) -> None:
    from swapsched.budget import format_bytes

    if r["oom"]:
        print(f"OOM at event {r['oom_event']}: the plan does not fit {format_bytes(r['budget_bytes'])}")
    else:
        print(f"step {1e3 * r['iteration_s']:.3f} ms   ideal {1e3 * r['ideal_s']:.3f} ms   overhead {round(100 * r['overhead'], 2) + 0.0:+.2f}%"
              f"   stall {1e3 * r['stall_s']:.3f} ms" + (f"   recompute {1e3 * r['recompute_s']:.3f} ms" if r.get("recompute_s") else ""))
    print(f"peak {format_bytes(r['peak_bytes'])} of budget {format_bytes(r['budget_bytes'])}   "
          f"moved d2h {format_bytes(r['d2h_bytes'])}  h2d {format_bytes(r['h2d_bytes'])}")
    st = r.get("state")
    if st:
        print(f"state off the device: parameters {format_bytes(st['param_off_bytes'])}, gradients "
              f"{format_bytes(st['grad_off_bytes'])}, optimizer {format_bytes(st['optim_off_bytes'])}; stepped on "
              f"{st['where_stepped']} (device {1e3 * st['device_step_s']:.3f} ms, host {1e3 * st['host_step_s']:.3f} ms); "
              f"host peak {format_bytes(r['host_peak_bytes'])}" + (f"; {st['skipped']} group(s) kept for the host budget"
                                                                  if st["skipped"] else ""))
        if st.get("disk_bytes") or st.get("disk_skipped"):  # R19
            print(f"disk: {format_bytes(st['disk_bytes'])} at rest, read {format_bytes(st['disk_read_bytes'])}, written "
                  f"{format_bytes(st['disk_written_bytes'])} a step; staging {format_bytes(st['staging_bytes'])} of the host "
                  "peak" + (f"; {st['disk_skipped']} group(s) kept on the host for the disk budget" if st["disk_skipped"] else ""))
        if st.get("gathered_bytes"):  # R18: one rank of a sharded step
            print(f"collectives (one rank of the job): all-gathered {format_bytes(st['gathered_bytes'])}, reduce-scattered "
                  f"{format_bytes(st['reduced_bytes'])}, {1e3 * st['collective_s']:.3f} ms on their streams, "
                  f"{1e3 * st['collective_stall_s']:.3f} ms of compute waiting; the node's host peak "
                  f"{format_bytes(r['node_host_peak_bytes'])} ({r['host_ranks']} ranks)")
    if r.get("bound_s") is not None:
        print(f"proven lower bound {1e3 * r['bound_s']:.3f} ms: this plan is within {max(100 * r['gap'], 0.0):.2f}% of the best possible")


def cmd_simulate(args: argparse.Namespace) -> int:
    from swapsched.env.simulator import simulate
    from swapsched.plan import load_plan

    trace, hw, budget = _load_case(args.trace, args.hardware, args.budget, args.executor, args.host_budget, args.disk_budget)
    plan = load_plan(args.plan, trace)
    res = simulate(trace, plan, hw, budget, record=bool(args.plot), validate=False)
    d = res.to_dict()
    if "bound_s" in plan.meta and not res.oom:  # a plan from optimal carries its proven bound
        d.update(bound_s=plan.meta["bound_s"], gap=(res.iteration_s - plan.meta["bound_s"]) / res.iteration_s)
    _print_result(d)
    if args.json:
        _write_json(d, args.json)
    if args.plot:
        from swapsched.plots import plot_timelines

        plot_timelines([(plan.policy, res)], budget, args.plot, title=f"{trace.name}, {_simulated_on(trace, hw)}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from collections import Counter

    from swapsched.agents.evaluate import run_policy
    from swapsched.agents.registry import get_policy

    trace, hw, budget = _load_case(args.trace, args.hardware, args.budget, args.executor, args.host_budget, args.disk_budget)
    policy = get_policy(args.policy, seed=args.seed, search_seconds=args.search_seconds)
    plan, res, plan_s = run_policy(policy, trace, budget, hw)
    plan.save(args.out)
    blocks = [f"{len(names)} block(s) recomputed {how}" for names, how in ((plan.recompute, "whole"),
                                                                         (plan.selective, "selectively")) if names]
    if plan.state:  # R13: where the state groups went
        counts = Counter(plan.placement().values())
        blocks.append("state groups placed " + ", ".join(f"{n} {w}" for w, n in sorted(counts.items()))
                      + f" (of {len(trace.state)})")
    print(f"{policy.name}: {len(plan.evictions)} of {trace.n_tensors} tensors evicted"
          + "".join(f", {b}" for b in blocks) + f", planned in {plan_s:.3f} s"
          + (f"; status {plan.meta['status']}" if "status" in plan.meta else ""))
    d = res.to_dict()
    if "bound_s" in plan.meta and not res.oom:
        d.update(bound_s=plan.meta["bound_s"], gap=(res.iteration_s - plan.meta["bound_s"]) / res.iteration_s)
    _print_result(d)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- compare


def cmd_compare(args: argparse.Namespace) -> int:
    from swapsched.agents.evaluate import compare, run_policy, summarize
    from swapsched.agents.registry import expand_policies
    from swapsched.env.corpus import load_corpus
    from swapsched.hardware import load_hardware
    from swapsched.report import format_state, format_summary, format_table
    from swapsched.trace_file import load_trace

    policies = expand_policies(args.policies)
    hws = [load_hardware(h).for_executor(args.executor).with_host(ranks_per_host=r, host_budget_bytes=args.host_budget,
                                                                       disk_budget_bytes=args.disk_budget)
           for h in args.hardware for r in args.ranks_per_host]
    traces = [load_trace(t) for t in args.traces] if args.traces else [*load_corpus("train"), *load_corpus("test")]  # the zoo's
    rows = compare(traces, args.budgets, hws, policies, seed=args.seed, search_seconds=args.search_seconds,
                   progress=not args.no_progress)
    print(format_table(rows, policies))
    if any(r.result is not None and r.result.state is not None for r in rows):
        print()
        print(format_state(rows, policies))
    left = [p for p in ("local-search", "swapadvisor", "optimal")
            if not any(q == p or q.startswith(f"{p}:") for q in policies)]  # optimal:2s is optimal
    if left:
        print(f"(not run, slower: {', '.join(left)}; add them with --policies)")
    print()
    summary = summarize(rows, policies)
    print(format_summary(summary))
    if args.json:
        _write_json({"rows": [r.to_dict() for r in rows], "summary": [s.to_dict() for s in summary]}, args.json)
    if args.plot:
        from swapsched.agents.registry import get_policy
        from swapsched.budget import format_bytes, parse_budget
        from swapsched.plots import plot_compare, plot_timelines

        plot_compare(rows, policies, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
        # one case in detail: the first that some policy solved, every policy's memory timeline
        solved = [r for r in rows if r.solved]
        if solved:
            first = solved[0]
            tr = next(t for t in traces if t.name == first.trace)
            hw = next(h for h in hws if h.name == first.hardware)
            b = parse_budget(first.budget, tr)
            detail = []
            for r in rows:
                if r.case == first.case and not r.skipped:
                    pol = get_policy(r.policy, seed=args.seed, search_seconds=args.search_seconds)
                    detail.append((r.policy, run_policy(pol, tr, b, hw, record=True)[1]))
            stem = Path(args.plot)
            timeline_path = stem.with_name(stem.stem + "-timeline" + stem.suffix)
            plot_timelines(detail, b, timeline_path, title=f"{tr.name} at {format_bytes(b)}, {_simulated_on(tr, hw)}")
            print(f"wrote {timeline_path}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    from swapsched.budget import format_bytes
    from swapsched.report import format_live, format_runs
    from swapsched.run import NothingToSwap, run_runtime

    if args.world_size > 1:
        if args.host_budget is not None or args.disk is not None:
            raise UserError("--host-budget and --disk are one device's (R11, R19): leave them out with --world-size")
        return _run_sharded(args)

    common: dict[str, Any] = dict(size=args.size, batch_size=args.batch_size, seq_len=args.seq_len)
    if args.disk_budget is not None and args.disk is None or args.disk is not None and args.host_budget is None:
        raise UserError("--disk-budget is the room under --disk, and --disk holds what --host-budget cannot: give "
                        "--host-budget with --disk, and --disk with --disk-budget")
    memory = {k: v for k, v in (("host_budget", args.host_budget), ("disk", args.disk), ("disk_budget", args.disk_budget))
              if v is not None}
    if memory:
        common["memory"] = memory
    say_if_shrunk(args.model, args.size)
    progress = not args.no_progress

    def show(s: int, dt: float, ok: bool, rep: Any) -> None:
        if not progress:
            return
        mem = (f"peak {format_bytes(rep.peak_device_bytes)} / budget {format_bytes(rep.budget_bytes)}"
               if rep.peak_device_bytes is not None else "profiling (save_on_cpu semantics)")
        print(f"step {s + 1:>3}  {1e3 * dt:8.2f} ms  {rep.mode:<8} {mem}  loss {'matches' if ok else 'DIFFERS'}", flush=True)

    try:
        main_run = run_runtime(args.model, args.policy, args.budget, args.steps, backend=args.backend, optimizer=args.optimizer,
                               bandwidth=args.bandwidth, hardware=args.hardware, on_step=show, **common)
    except NothingToSwap as exc:
        print(exc)
        return 0
    print()
    print(format_runs([main_run]))
    out: dict[str, Any] = {"model": args.model, "size": args.size, "budget": args.budget, "runs": [_run_json(main_run)]}
    if args.compare:
        from tqdm import tqdm

        from swapsched.agents.registry import policy_names
        from swapsched.run import compare_live

        # each planner once: the swap-only forms of joint planners are left to compare; the
        # peers (checkpointing, selective checkpointing, save_on_cpu, checkpoint-offload) are rows of their own
        # the state peers are rows of their own where the state moves (zero-offload, fsdp-offload,
        # ao-offload), and the sharded and frozen-weight peers plan other steps (R18, R13)
        skip = {"optimal", "swapadvisor", "default-swap", "capuchin-swap", "checkpoint-all", "checkpoint-selective",
                "checkpoint-offload", "swap-all", "no-swap", "local-search", "zero-offload", "fsdp-offload", "ao-offload",
                "fsdp", "fsdp-partial", "zero3-offload", "accelerate-offload", "zero-infinity"}
        others = args.compare_policies or [p for p in policy_names() if p not in skip]
        policies = [args.policy, *[p for p in others if p != args.policy]]
        bar = tqdm(desc="compare", unit="step", disable=not progress, file=sys.stderr)

        def tick(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update()

        live = compare_live(args.model, args.budget, policies, backend=args.backend, bandwidth=args.bandwidth, optimizer=args.optimizer,
                            hardware=args.hardware, rounds=args.rounds, round_steps=args.round_steps, progress=tick, **common)
        bar.close()
        print()
        print(format_live(live))
        out["compare"] = live.to_dict()
    if args.json:
        _write_json(out, args.json)
    if args.plot:
        from swapsched.plots import plot_runs

        plot_runs(live.rows if args.compare else [main_run], args.plot, title=f"{args.model} {args.size or ''} at {args.budget}",
                  budget_bytes=live.budget_bytes if args.compare else main_run.budget_bytes)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if main_run.loss_matches else 1


def _run_sharded(args: argparse.Namespace) -> int:
    """``run --world-size N``: FSDP2 on N gloo ranks (``run_sharded.py``)."""
    from swapsched.run_sharded import format_sharded, run_sharded

    if args.backend == "cuda" or args.policy != "default" or args.plot:
        raise UserError("--world-size runs gloo ranks on the CPU backend with policy default (no --plot): "
                        "leave --backend, --policy and --plot out")
    say_if_shrunk(args.model, args.size)
    rows = run_sharded(args.model, args.budget, args.world_size, size=args.size, batch_size=args.batch_size,
                       seq_len=args.seq_len, compare=args.compare, rounds=args.rounds, round_steps=args.round_steps)
    print(format_sharded(rows, args.world_size))
    if args.json:
        _write_json({"model": args.model, "size": args.size, "budget": args.budget, "world_size": args.world_size,
                     "rows": [r.to_dict() for r in rows]}, args.json)
    return 0 if all(r.bit_identical for r in rows if r.units) else 1


def _run_json(r: Any) -> dict[str, Any]:
    d = r.to_dict()
    d.pop("extra", None)
    d.pop("step_s", None)
    return d



# ----------------------------------------------------------------------------- calibrate


def cmd_calibrate(args: argparse.Namespace) -> int:
    from swapsched.runtime.backends import resolve_backend
    from swapsched.runtime.calibrate import calibrate

    resolve_backend(args.backend)  # a clear error where there is no CUDA device
    cal = calibrate(args.backend, bandwidth=args.bandwidth, name=args.name, progress=not args.no_progress,
                    world_size=args.world_size, disk=args.disk)
    hw = cal.hardware
    cal.save(args.out)  # each number with where it came from
    print(f"d2h {hw.d2h_bytes_per_s / 1e9:.3f} GB/s   h2d {hw.h2d_bytes_per_s / 1e9:.3f} GB/s   "
          f"latency {1e6 * hw.copy_latency_s:.1f} us (idle engine +{1e6 * hw.copy_wake_s:.1f})   hook {1e6 * hw.hook_cost_s:.2f} us/event   "
          f"copy issue {1e6 * hw.copy_issue_s:.1f} us   per byte {1e9 * hw.copy_host_s_per_byte:.3f} ns   "
          f"wait resume {1e6 * hw.wait_resume_s:.1f} us   state mover {1e6 * hw.state_hook_s:.1f} us/tensor")
    if hw.collective_bytes_per_s is not None:
        print(f"collectives over {args.world_size} ranks: {hw.collective_bytes_per_s / 1e9:.3f} GB/s bus bandwidth, "
              f"latency {1e6 * hw.collective_latency_s:.1f} us")
    if hw.disk_read_bytes_per_s is not None and hw.disk_write_bytes_per_s is not None:
        print(f"disk under {args.disk}: read {hw.disk_read_bytes_per_s / 1e9:.3f} GB/s   write "
              f"{hw.disk_write_bytes_per_s / 1e9:.3f} GB/s   latency {1e6 * hw.disk_latency_s:.1f} us")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- train-policy


def cmd_train_policy(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from swapsched.agents.train import load_train_config, train_policy, train_search
    from swapsched.report import format_ratios, format_summary

    config = load_train_config(args.config)
    if args.seed is not None:
        config = replace(config, seed=args.seed)
    if args.n_envs is not None:
        config = replace(config, n_envs=args.n_envs)
    timesteps = 2048 if args.quick else args.timesteps
    if timesteps is not None and args.resume is None:
        config = config.scaled(timesteps)  # a short run's search parts are short too
    if args.search_only:
        from swapsched.agents.learned import resolve_checkpoint

        parts = train_search(config, resolve_checkpoint(args.out), progress=not args.no_progress)
        print("wrote " + " and ".join(str(p) for p in parts.paths) + f" ({parts.traces} traces of {', '.join(parts.splits)}, "
              f"{parts.seconds:.0f} s)")
        return 0
    if args.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    res = train_policy(config, args.out, progress=not args.no_progress, timesteps=timesteps, resume=args.resume,
                       tensorboard=args.tensorboard)
    print(f"wrote {res.checkpoint} and {res.card.name} ({res.timesteps} steps, {res.train_seconds:.0f} s this run)"
          + (f"; best on validation: {res.best_checkpoint}" if res.best_checkpoint else ""))
    if res.interrupted:
        config_arg = f"--config {args.config} " if args.config != str(default_train_config()) else ""
        if res.stopped_in == "ppo":
            how = f"continue PPO with  swapsched train-policy {config_arg}--resume {res.checkpoint} --out {res.checkpoint}"
        elif res.stopped_in == "search parts":
            size = "--quick " if args.quick else f"--timesteps {args.timesteps} " if args.timesteps else ""
            how = (f"PPO is done and saved; learn the search parts with  swapsched train-policy {config_arg}{size}"
                   f"--search-only --out {res.checkpoint}")
        else:
            how = (f"the checkpoint is complete; its held-out table was not made: swapsched compare --policies "
                   f"min,capuchin,{res.checkpoint}")
        print(f"interrupted in {res.stopped_in}: {how}", file=sys.stderr)
        return 130
    assert res.held_out is not None  # evaluated: training was not interrupted
    print(f"held-out traces: {', '.join(res.held_out.traces)}")
    print(format_summary(res.held_out.summary))
    if res.held_out.ratios:
        print(format_ratios(res.held_out.ratios))
    return 0


def default_train_config() -> Path:
    from swapsched._paths import config_dir

    return config_dir() / "train" / "default.yaml"
