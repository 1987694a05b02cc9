"""The ``swapsched`` command. Every sub-command has ``--help``; bad input exits 2 with one line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from swapsched.errors import UserError
from swapsched.hardware import DEFAULT_GPU_HARDWARE, EXECUTORS

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line (no usage dump) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _csv(value: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items


#: What ``compare`` runs by default: the single-pass heuristics and the shipped planner (under 1 s a case).
FAST_POLICIES = ("swap-all", "vdnn-all", "min", "capuchin", "checkpoint-all", "checkpoint-selective", "default")


def _budgets(value: str) -> list[str]:
    """A comma list of budgets, each checked for form where it is given."""
    from swapsched.budget import BudgetError, check_budget

    items = _csv(value)
    for item in items:
        try:
            check_budget(item)
        except BudgetError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return items


def _host_budget(value: str) -> int:
    """A host budget (R11): bytes, like '64GiB' (a percentage has nothing to be a share of)."""
    from swapsched.budget import BudgetError, parse_budget

    if value.strip().endswith("%"):
        raise argparse.ArgumentTypeError(f"host budget {value!r}: give bytes, like '64GiB' (pinned host memory for this rank)")
    try:
        return parse_budget(value)
    except BudgetError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("budget", "host budget", 1)) from None


def _ranks(value: str) -> list[int]:
    """A comma list of ranks per host, each a positive integer."""
    out = []
    for item in _csv(value):
        if not item.isdigit() or int(item) < 1:
            raise argparse.ArgumentTypeError(f"ranks per host must be positive integers, got {item!r}")
        out.append(int(item))
    return out


def _budget(value: str) -> str:
    """One budget, checked for form where it is given."""
    from swapsched.budget import BudgetError, check_budget

    try:
        return str(check_budget(value))
    except BudgetError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _writable(path: Path) -> None:
    """Make ``path``'s folder and prove a file can be written in it, before any work is done."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".swapsched-probe-"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write in {path}: {exc.strerror or exc}") from None


def _out_file(value: str) -> str:
    """An argparse type: a file path the command can write (checked now, written at the end)."""
    _writable(Path(value).parent)
    return value


def _out_dir(value: str) -> str:
    """An argparse type: a folder the command can write files in."""
    _writable(Path(value))
    return value


def _in_file(value: str) -> str:
    """An argparse type: a file that exists."""
    if not Path(value).is_file():
        raise argparse.ArgumentTypeError(f"{value}: no such file")
    return value


def _policy_list(value: str) -> list[str]:
    """A comma list of policy names, each checked against the registry where it is given."""
    from swapsched.agents.registry import expand_policies

    try:
        return expand_policies(value)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _simulated_on(trace: Any, hw: Any) -> str:
    """Where a plot's simulation runs: a trace measured on the CPU keeps its CPU compute times
    and borrows only the profile's links, and the title says so."""
    if trace.timing == "measured" and not str(trace.device).startswith("cuda"):
        return f"simulated with {hw.name}'s links (compute as measured on {trace.device})"
    return f"simulated on {hw.name}"


def _positive(cast: type) -> Callable[[str], Any]:
    """An argparse type: a positive int or float, or one clear line."""
    kind = "integer" if cast is int else "number"

    def parse(value: str) -> Any:
        try:
            v = cast(value)
        except ValueError:
            v = None
        if v is None or not v > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind}, got {value!r}")
        return v

    parse.__name__ = f"positive {kind}"
    return parse


_positive_int = _positive(int)
_positive_float = _positive(float)


def _write_json(data: Any, path: str) -> None:
    from swapsched.jsonfile import write_json

    p = write_json(data, path, indent=2)
    print(f"wrote {p}", file=sys.stderr)


# ----------------------------------------------------------------------------- profile / inspect


def _say_if_shrunk(model: str, size: str | None) -> None:
    """hf: models are built small unless asked for the library's full configuration: say so."""
    if model.startswith("hf:") and size in (None, "small"):
        print(f"{model}: built small (2 layers, width 128, vocabulary 1024); --size full builds the library's "
              "default configuration", file=sys.stderr)


def cmd_profile(args: argparse.Namespace) -> int:
    from swapsched.hardware import DEFAULT_CPU_HARDWARE, DEFAULT_GPU_HARDWARE, load_hardware
    from swapsched.precision import Precision
    from swapsched.trace_file import save_trace

    _say_if_shrunk(args.model, args.size)
    device = args.device
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device is available here; use --device cpu or meta")
    for_gpu = device != "cpu" or args.hardware is not None
    precision = Precision(args.dtype or ("bf16" if for_gpu else "fp32"), amp=args.amp)
    target = load_hardware(args.hardware or (DEFAULT_GPU_HARDWARE if for_gpu else DEFAULT_CPU_HARDWARE))
    target.peak_flops_for(precision.compute_dtype)  # a dtype the hardware lacks: one line, before any work
    # the CPU's own measured step runs SDPA as it is; for a GPU, as the GPU's kernel would
    attention = args.attention or ("auto" if for_gpu else None)
    trace = _profile_case(args, device, precision, attention, target.name if for_gpu else None)
    out = args.out or f"{trace.name}.json.gz"
    save_trace(trace, out)
    _print_summary(trace.summary())
    print(f"precision    {precision} (compute {precision.compute_dtype}); attention {_kernels_used(trace.meta)}")
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _kernels_used(meta: dict[str, Any]) -> str:
    used = meta.get("attention")
    if used is None:
        return "as SDPA ran on the profiling device"
    return ", ".join(f"{k} x{n}" for k, n in used.items()) or "the model's own (no SDPA call)"


#: What a forward says when it reads a tensor's values, which the meta device has none of
_READS_VALUES = ("cannot be called on meta tensors", "Cannot copy out of meta tensor", "data-dependent")


def _profile_case(args: argparse.Namespace, device: str, precision: Any, attention: str | None, target: str | None) -> Any:
    """Build and profile the case; an ``hf:`` model whose forward reads tensor values (which meta
    cannot run) is profiled on the CPU instead where its size fits there, timed by roofline for the
    target; any other failure of a ``hf:`` model's step is one line (exit 2)."""
    import torch

    from swapsched.hf_models import one_line
    from swapsched.runtime.profiler import profile
    from swapsched.zoo import build_model

    def run_on(dev: str) -> Any:
        case = build_model(args.model, args.size, batch_size=args.batch_size, seq_len=args.seq_len, device=dev,
                           dtype=precision.param_dtype, attention=attention)
        optimizer = _optimizer(args.optimizer, case.model)
        return profile(case.model, case.inputs, case.loss_fn, optimizer, device=dev, name=case.name, hardware=target,
                       precision=precision, attention=attention)

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


def _optimizer(name: str, model: Any) -> Any:
    """The optimizer whose state the trace's static bytes count (state in the parameters' dtype)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if name == "none" or not params:
        return None
    return torch.optim.AdamW(params) if name == "adamw" else torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _print_summary(s: dict[str, Any]) -> None:
    from swapsched.budget import format_bytes

    c = s["compute_s"]
    print(f"trace        {s['name']}  ({s['timing']} on {s['device']})")
    print(f"tensors      {s['tensors']}   events {s['events']}")
    print(f"saved peak   {format_bytes(s['saved_bytes_peak'])}  (nothing evicted)")
    print(f"static       {format_bytes(s['static_bytes'])}  (params, grads, optimizer state)")
    print(f"device peak  {format_bytes(s['peak_bytes_no_swap'])}  (no swap; 100%)   smallest feasible {format_bytes(s['min_feasible_bytes'])}")
    print(f"compute      forward {1e3 * c['forward']:.3f} ms   backward {1e3 * c['backward']:.3f} ms   step {1e3 * c['total']:.3f} ms")


def cmd_inspect(args: argparse.Namespace) -> int:
    from swapsched.trace_file import load_trace

    s = load_trace(args.trace).summary()
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        _print_summary(s)
    return 0


# ----------------------------------------------------------------------------- simulate / plan


def _load_case(trace_path: str, hardware: str, budget: str, executor: str = "hooks",
               host_budget: int | None = None) -> tuple[Any, Any, int]:
    from swapsched.budget import parse_budget
    from swapsched.hardware import load_hardware
    from swapsched.trace_file import load_trace

    trace = load_trace(trace_path)
    hw = load_hardware(hardware).for_executor(executor).with_host(host_budget_bytes=host_budget)
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
    if r.get("bound_s") is not None:
        print(f"proven lower bound {1e3 * r['bound_s']:.3f} ms: this plan is within {max(100 * r['gap'], 0.0):.2f}% of the best possible")


def cmd_simulate(args: argparse.Namespace) -> int:
    from swapsched.env.simulator import simulate
    from swapsched.plan import load_plan

    trace, hw, budget = _load_case(args.trace, args.hardware, args.budget, args.executor, args.host_budget)
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
    from swapsched.agents.evaluate import run_policy
    from swapsched.agents.registry import get_policy

    trace, hw, budget = _load_case(args.trace, args.hardware, args.budget, args.executor, args.host_budget)
    policy = get_policy(args.policy, seed=args.seed, search_seconds=args.search_seconds)
    plan, res, plan_s = run_policy(policy, trace, budget, hw)
    plan.save(args.out)
    blocks = [f"{len(names)} block(s) recomputed {how}" for names, how in ((plan.recompute, "whole"),
                                                                         (plan.selective, "selectively")) if names]
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
    from swapsched.report import format_summary, format_table
    from swapsched.trace_file import load_trace

    policies = expand_policies(args.policies)
    hws = [load_hardware(h).for_executor(args.executor).with_host(ranks_per_host=r, host_budget_bytes=args.host_budget)
           for h in args.hardware for r in args.ranks_per_host]
    traces = [load_trace(t) for t in args.traces] if args.traces else [*load_corpus("train"), *load_corpus("test")]  # the zoo's
    rows = compare(traces, args.budgets, hws, policies, seed=args.seed, search_seconds=args.search_seconds,
                   progress=not args.no_progress)
    print(format_table(rows, policies))
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
        from swapsched.budget import parse_budget
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
            plot_timelines(detail, b, timeline_path, title=f"{tr.name} at {first.budget}, {_simulated_on(tr, hw)}")
            print(f"wrote {timeline_path}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    from swapsched.budget import format_bytes
    from swapsched.report import format_live, format_runs
    from swapsched.run import NothingToSwap, run_runtime

    common = dict(size=args.size, batch_size=args.batch_size, seq_len=args.seq_len)
    _say_if_shrunk(args.model, args.size)
    progress = not args.no_progress

    def show(s: int, dt: float, ok: bool, rep: Any) -> None:
        if not progress:
            return
        mem = (f"peak {format_bytes(rep.peak_device_bytes)} / budget {format_bytes(rep.budget_bytes)}"
               if rep.peak_device_bytes is not None else "profiling (save_on_cpu semantics)")
        print(f"step {s + 1:>3}  {1e3 * dt:8.2f} ms  {rep.mode:<8} {mem}  loss {'matches' if ok else 'DIFFERS'}", flush=True)

    try:
        main_run = run_runtime(args.model, args.policy, args.budget, args.steps, backend=args.backend,
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
        skip = {"optimal", "swapadvisor", "default-swap", "capuchin-swap", "checkpoint-all", "checkpoint-selective",
                "checkpoint-offload", "swap-all", "no-swap", "local-search"}
        others = args.compare_policies or [p for p in policy_names() if p not in skip]
        policies = [args.policy, *[p for p in others if p != args.policy]]
        bar = tqdm(desc="compare", unit="step", disable=not progress, file=sys.stderr)

        def tick(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update()

        live = compare_live(args.model, args.budget, policies, backend=args.backend, bandwidth=args.bandwidth,
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
    cal = calibrate(args.backend, bandwidth=args.bandwidth, name=args.name, progress=not args.no_progress)
    hw = cal.hardware
    cal.save(args.out)  # each number with where it came from
    print(f"d2h {hw.d2h_bytes_per_s / 1e9:.3f} GB/s   h2d {hw.h2d_bytes_per_s / 1e9:.3f} GB/s   "
          f"latency {1e6 * hw.copy_latency_s:.1f} us   hook {1e6 * hw.hook_cost_s:.2f} us/event   "
          f"copy issue {1e6 * hw.copy_issue_s:.1f} us   per byte {1e9 * hw.copy_host_s_per_byte:.3f} ns   "
          f"wait resume {1e6 * hw.wait_resume_s:.1f} us")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- train-policy


def cmd_train_policy(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from swapsched.agents.train import load_train_config, train_policy, train_search
    from swapsched.report import format_summary

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
        config_arg = f"--config {args.config} " if args.config != str(_default_train_config()) else ""
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
    return 0


# ----------------------------------------------------------------------------- the parser


def build_parser() -> argparse.ArgumentParser:
    from swapsched import __version__

    p = _Parser(prog="swapsched", description="Learned and heuristic activation-swap scheduling for PyTorch training.")
    p.add_argument("--version", action="version", version=f"swapsched {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(fn=fn)
        return sp

    sp = add("profile", cmd_profile, "Profile one training step of a zoo model into a trace.")
    sp.add_argument("model", help="zoo family (mlp, vgg, resnet, gpt, bert, unet), hf:MODEL_TYPE, or package.module:function")
    sp.add_argument("--size", help="size from configs/models/FAMILY.yaml (default: small)")
    sp.add_argument("--batch-size", type=_positive_int, help="batch size (default: the size's own)")
    sp.add_argument("--seq-len", type=_positive_int, help="sequence length (gpt, bert, hf:)")
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
    sp.add_argument("--optimizer", choices=["adamw", "sgd", "none"], default="adamw",
                    help="whose state the static bytes count (default adamw: 2 states per parameter)")
    sp.add_argument("--out", type=_out_file, help="output trace (.json or .json.gz; default MODEL-SIZE.json.gz)")

    sp = add("inspect", cmd_inspect, "Summarize a trace.")
    sp.add_argument("trace")
    sp.add_argument("--json", action="store_true", help="print JSON")

    sp = add("simulate", cmd_simulate, "Simulate a plan on a trace (rules R1-R8).")
    sp.add_argument("--trace", required=True, help="trace file (.json or .json.gz)")
    sp.add_argument("--plan", required=True, help="plan file written by swapsched plan")
    sp.add_argument("--hardware", required=True, help="name (configs/hardware) or YAML path")
    sp.add_argument("--budget", type=_budget, required=True, help="'6GiB', '6e9' or '60%%' of the activation peak")
    sp.add_argument("--json", metavar="OUT", type=_out_file, help="write the result as JSON")
    sp.add_argument("--plot", metavar="PNG", type=_out_file, help="draw memory over time and the three streams")
    sp.add_argument("--executor", choices=EXECUTORS, default="hooks",
                    help="who executes the plan (R10): hooks (SwapRuntime, its host costs, two copy streams) or "
                         "compiled (CompileBackend: no hook costs, one transfer stream); default hooks")
    sp.add_argument("--host-budget", type=_host_budget, metavar="BYTES",
                    help="host memory this rank's swapped tensors may hold at once, like '64GiB' (R11; default unlimited)")

    sp = add("plan", cmd_plan, "Make a plan with a policy and write it as JSON.")
    sp.add_argument("--trace", required=True, help="trace file (.json or .json.gz)")
    sp.add_argument("--policy", required=True, help="registry name (see compare --help) or a checkpoint .zip")
    sp.add_argument("--hardware", required=True, help="name (configs/hardware) or YAML path")
    sp.add_argument("--budget", type=_budget, required=True, help="'6GiB', '6e9' or '60%%' of the activation peak")
    sp.add_argument("--out", required=True, type=_out_file, help="plan file to write (JSON)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the randomized policies (default 0)")
    sp.add_argument("--search-seconds", type=_positive_float, default=10.0, help="time box of swapadvisor")
    sp.add_argument("--executor", choices=EXECUTORS, default="hooks",
                    help="who executes the plan (R10): hooks (SwapRuntime, its host costs, two copy streams) or "
                         "compiled (CompileBackend: no hook costs, one transfer stream); default hooks")
    sp.add_argument("--host-budget", type=_host_budget, metavar="BYTES",
                    help="host memory this rank's swapped tensors may hold at once, like '64GiB' (R11; default unlimited)")

    sp = add("compare", cmd_compare, "Compare policies on traces x budgets x hardware in one table.")
    sp.add_argument("--traces", nargs="+", metavar="T", help="trace files (default: the shipped corpus of zoo models, train and test splits)")
    sp.add_argument("--budgets", type=_budgets, default=["30%", "50%", "70%"], help="comma list (default 30%%,50%%,70%%)")
    sp.add_argument("--hardware", type=_csv, default=[DEFAULT_GPU_HARDWARE],
                    help=f"comma list of names or YAML paths (default {DEFAULT_GPU_HARDWARE})")
    sp.add_argument("--executor", choices=EXECUTORS, default="hooks",
                    help="who executes the plan (R10): hooks (SwapRuntime, its host costs, two copy streams) or "
                         "compiled (CompileBackend: no hook costs, one transfer stream); default hooks")
    sp.add_argument("--host-budget", type=_host_budget, metavar="BYTES",
                    help="host memory this rank's swapped tensors may hold at once, like '64GiB' (R11; default unlimited)")
    sp.add_argument("--ranks-per-host", type=_ranks, default=[1], metavar="N[,N...]",
                    help="ranks sharing the host's memory bandwidth (R11: FSDP/DDP ranks on one node), a row per value; default 1")
    sp.add_argument("--policies", default=",".join(FAST_POLICIES),
                    help="'all' or a comma list of: no-swap, swap-all, vdnn-all, vdnn-conv, min, capuchin, capuchin-swap, "
                         "checkpoint-all, checkpoint-selective, local-search, swapadvisor, optimal, optimal:SECONDSs, "
                         "default, default-swap, default-greedy, default-ppo, learned:PATH.zip, "
                         f"learned-greedy:PATH.zip, learned-ppo:PATH.zip (default: {','.join(FAST_POLICIES)}; the searches "
                         "local-search, swapadvisor and optimal take 1-60 s per case)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the randomized policies (default 0)")
    sp.add_argument("--search-seconds", type=_positive_float, default=2.0, help="time box of swapadvisor per case")
    sp.add_argument("--json", metavar="OUT", type=_out_file, help="write every row and the summary as JSON")
    sp.add_argument("--plot", metavar="PNG", type=_out_file, help="heat map of each policy's step over the R8 floor per budget (+ PNG-timeline for the first case)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")

    sp = add("run", cmd_run, "Train a zoo model with the live runtime; --compare runs every policy and PyTorch's peers.")
    sp.add_argument("model", help="zoo family, hf:MODEL_TYPE, or package.module:function")
    sp.add_argument("--size", help="size from configs/models/FAMILY.yaml (default: small)")
    sp.add_argument("--batch-size", type=_positive_int, help="batch size (default: the size's own)")
    sp.add_argument("--seq-len", type=_positive_int, help="sequence length (gpt, bert, hf:)")
    sp.add_argument("--budget", type=_budget, default="50%", help="'60%%' of the activation peak, or bytes like '6GiB' (default 50%%)")
    sp.add_argument("--policy", default="default", help="registry name or checkpoint .zip (default: the learned policy)")
    sp.add_argument("--steps", type=_positive_int, default=10, help="training steps, the first 3 are profiled (default 10)")
    sp.add_argument("--backend", choices=["cpu", "cuda"], help="default: cuda when available")
    sp.add_argument("--bandwidth", type=_positive_float, help="CPU backend: throttle both copy engines to this many bytes/s")
    sp.add_argument("--hardware", help="profile the plan is made for (default: cpu-emulated on cpu, h100-pcie5 on cuda)")
    sp.add_argument("--compare", action="store_true",
                    help="also run the other policies and the peers (plain, checkpointing, selective checkpointing, "
                         "save_on_cpu, checkpoint-offload) in shuffled interleaved rounds, each with its measured peak")
    sp.add_argument("--rounds", type=_positive_int, default=6, help="with --compare: interleaved rounds (default 6, at least 2)")
    sp.add_argument("--round-steps", type=_positive_int, default=2, help="with --compare: steps per method per round (default 2)")
    sp.add_argument("--compare-policies", type=_policy_list, help="with --compare: which other policies (default: all but optimal, swapadvisor)")
    sp.add_argument("--json", metavar="OUT", type=_out_file, help="write one record per method as JSON")
    sp.add_argument("--plot", metavar="PNG", type=_out_file, help="step time and peak memory per method")
    sp.add_argument("--no-progress", action="store_true", help="no per-step lines")

    sp = add("calibrate", cmd_calibrate, "Measure this machine's link and the runtime's host costs into a hardware YAML for the simulator.")
    sp.add_argument("--backend", choices=["cpu", "cuda"], default="cpu", help="backend whose copies are measured (default cpu)")
    sp.add_argument("--bandwidth", type=_positive_float, help="CPU backend: measure the engines throttled to this many bytes/s")
    sp.add_argument("--name", help="profile name (default calibrated-BACKEND)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.add_argument("--out", default="calibrated.yaml", type=_out_file, help="hardware YAML to write (default calibrated.yaml)")

    sp = add("train-policy", cmd_train_policy, "Train a swap policy (MaskablePPO on SwapEnv) and evaluate it on held-out traces.")
    sp.add_argument("--config", default=str(_default_train_config()), help="PPO settings YAML (default: configs/train/default.yaml)")
    sp.add_argument("--out", default="checkpoints/mine.zip", type=_out_file, help="checkpoint path; NAME.json is written beside it")
    sp.add_argument("--timesteps", type=_positive_int, help="override the config's total_timesteps (with --resume: steps to add); PPO runs whole rollouts "
                    "(n_steps x n_envs), so it rounds up to the next multiple and says so")
    sp.add_argument("--seed", type=int, help="override the config's seed (training is deterministic for a seed with --n-envs 1)")
    sp.add_argument("--n-envs", type=_positive_int, help="override the config's n_envs (more than 1: subprocess environments)")
    sp.add_argument("--resume", metavar="CKPT", type=_in_file, help="continue this checkpoint: its step count, optimizer state and schedule")
    sp.add_argument("--tensorboard", metavar="DIR", type=_out_dir, help="write learning curves and the validation ratio to min here")
    sp.add_argument("--quick", action="store_true",
                    help="a short run, a couple of minutes end to end: --timesteps 2048 with the search parts scaled down alike "
                         "(any --timesteps below the config's scales them the same way)")
    sp.add_argument("--search-only", action="store_true",
                    help="only (re)learn the search's move prior, plan editor and block chooser for the existing checkpoint --out")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _default_train_config() -> Path:
    from swapsched._paths import config_dir

    return config_dir() / "train" / "default.yaml"


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


if __name__ == "__main__":
    sys.exit(main())
