"""A compiled step as a Trace: the partitioned forward and backward graphs, read as R1/R2 events.

AOTAutograd's partitioner splits the joint graph into a forward graph, whose outputs past the
model's own are the tensors saved for backward, and a backward graph, which takes those as
placeholders. Read as the eager hooks would have seen them (DESIGN.md, "The compiled executor"):

- **tensors** are the saved outputs that are not parameters or buffers (static-lifetime inputs
  are ``static_bytes``, R2) and not symbolic sizes; bytes come from the nodes' fake tensors;
- a saved tensor's **pack** is at its producer in the forward graph (a graph input is produced
  before the graph's first op); the program holds it through its last forward use (``released_at``);
- its **unpacks** are the backward nodes that read it, in the backward graph's order;
- **gaps** are the roofline times of the compute nodes between events, for the given hardware:
  ``max(flops / peak_flops, bytes read and written / memory_bytes_per_s)`` per node, FLOPs from
  torch's own formulas (``torch.utils.flop_counter``);
- a tensor torch cannot offload (:func:`offloadable`: views, ``getitem``s, non-contiguous tensors,
  model outputs, a base whose view is also saved) is no saved tensor of the trace: its bytes are
  ``other_bytes`` (R3) of every gap it is live in, so no plan can evict it and every plan pays for it;
- **blocks** (R9) come from the nodes' ``nn_module_stack``: a saved tensor's module is that of its
  first forward reader, as the eager hooks name a tensor by the op that saves it.
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from swapsched.hardware import Hardware, HardwareError
from swapsched.trace import Event, TensorInfo, Trace

__all__ = ["GraphTrace", "graph_trace", "module_path", "offloadable", "rebasable_views", "recomputable_held", "cloneable_getitems", "saved_nodes", "model_output_nodes", "merge_chains"]


@dataclass(frozen=True)
class GraphTrace:
    """A Trace of one compiled graph and where its tensors and events sit in the graphs.

    ``node_of[k]`` is the forward node (by name) of tensor ``k``; ``event_node[i]`` the name of
    the graph node at which event ``i`` happens (forward graph for packs, backward for unpacks);
    ``held`` the saved tensors the trace counts as ``other_bytes`` (name -> why)."""

    trace: Trace
    node_of: tuple[str, ...]
    event_node: tuple[str, ...]
    held: dict[str, str]
    #: bases saved in place of the views of them torch's partition saved (R10): the partition
    #: this trace reads was made with those views tagged to be rebuilt in backward
    rebased: tuple[str, ...] = ()
    #: clones of getitems (clone -> getitem) the plan keeps, taken out again before lowering
    #: (R10): the lowered partition saves the getitem where this trace has the clone
    uncloned: dict[str, str] = field(default_factory=dict)


def module_path(node: fx.Node) -> str:
    """The dotted module path of the innermost module a node ran in (``blocks.3.attn``), as the
    eager profiler names it; ``""`` outside any module. Dynamo names modules from the compiled
    callable's frame (``L['self'].blocks.3.attn`` or ``L['self'].blocks[3]``); the frame's root
    is dropped."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    path = re.sub(r"^L\['[^']*'\]\.?", "", path)
    path = re.sub(r"\.?_modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return path.strip(".")


def _forward_outputs(fw: fx.GraphModule) -> Sequence[Any]:
    """What the forward graph returns: the model's outputs, then what backward reads."""
    return fw.graph.find_nodes(op="output")[0].args[0]


def saved_nodes(fw: fx.GraphModule, num_fwd_outputs: int) -> list[fx.Node]:
    """The forward graph's outputs that backward reads: past the model's outputs, tensors only."""
    outs = _forward_outputs(fw)
    return [n for n in outs[num_fwd_outputs:] if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]


def model_output_nodes(fw: fx.GraphModule, num_fwd_outputs: int) -> set[fx.Node]:
    """The forward graph's outputs the model returns (torch cannot offload them)."""
    return {n for n in _forward_outputs(fw)[:num_fwd_outputs] if isinstance(n, fx.Node)}


def merge_chains(into: dict[str, list[str]], more: dict[str, list[str]]) -> bool:
    """Add ``more``'s bases and the nodes rebuilt from them (as :func:`rebasable_views` gives
    them) to ``into``; whether any was new."""
    new = False
    for base, chain in more.items():
        have = into.get(base)
        if have is None:
            have = into[base] = []
            new = True
        for c in chain:
            if c not in have:
                have.append(c)
                new = True
    return new


class _Views:
    """Which nodes are views of another node's storage: torch's partitioner's view ops, and every
    op whose schema says its output aliases its input (``transpose``, ``detach``: not on that
    list, yet the partitioner saves them in place of their bases for backward), and a ``getitem``
    of such an op's outputs (``split``, ``chunk``, ``unbind``). R10 holds a view (torch cannot
    offload it) and rebases it onto its base where that base is offloadable."""

    def __init__(self) -> None:
        from torch._functorch.partitioners import get_default_op_list

        self._torch = get_default_op_list()

    def is_view(self, node: fx.Node) -> bool:
        if node.op != "call_function":
            return False
        if self._torch.is_view(node):
            return True
        target: object = node.target
        if target is operator.getitem:
            src = node.args[0] if node.args else None
            target = src.target if isinstance(src, fx.Node) and src.op == "call_function" else None
        return isinstance(target, torch._ops.OpOverload) and target.is_view


@functools.cache
def _view_ops() -> _Views:
    """Views, as :class:`_Views` tells them, built once: every node of a graph asks."""
    return _Views()


def _base(node: fx.Node, ops) -> fx.Node:
    """The node whose storage a chain of views reads."""
    while ops.is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def offloadable(node: fx.Node, model_outputs: set[fx.Node], static: set[fx.Node], ops=None,
                taggable: frozenset[str] | None = None, needs_grad: set[fx.Node] | None = None) -> str | None:
    """Why torch's offloading cannot take ``node`` (the checks of
    ``torch._functorch._activation_offloading.can_offload``, and whether the joint graph has the
    node to tag: ``taggable``), or None if it can. A graph input is offloaded only where it needs
    a gradient (``needs_grad``): an activation of an earlier graph (the block before, under
    per-block compile), which its caller lets go once the graph has run."""
    ops = ops or _view_ops()
    if taggable is not None and node.op != "placeholder" and node.name not in taggable:
        return "made by the partitioner (no joint-graph node to tag)"
    if node in model_outputs:
        return "a model output"
    if node in static:
        return "a static input"
    if node.op == "placeholder" and not (needs_grad and node in needs_grad):
        return "a graph input that needs no gradient (the caller's batch: it holds it, offloading frees nothing)"
    if ops.is_view(node):
        return "a view"
    if node.target == operator.getitem:
        return "a getitem"
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and not val.is_contiguous():
        return "non-contiguous"
    return None


def _hint(s: object) -> int:
    """A size as an int; a symbolic size (dynamic shapes) at its hint, the size it was traced at."""
    if isinstance(s, torch.SymInt):
        return int(s.node.hint) if s.node.hint is not None else 1
    return int(s)  # type: ignore[call-overload]


def _nbytes(val: object) -> int:
    """Bytes of a tensor's elements (a saved tensor's storage, or its view's elements)."""
    if not isinstance(val, torch.Tensor):
        return 0
    return math.prod(_hint(s) for s in val.shape) * val.element_size()


def _tensor_vals(x: object) -> Iterable[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensor_vals(y)


def _meta(x: object) -> object:
    if isinstance(x, fx.Node):
        return x.meta.get("val")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta(y) for y in x)
    if isinstance(x, dict):
        return {k: _meta(v) for k, v in x.items()}
    return x


def node_seconds(node: fx.Node, hardware: Hardware) -> tuple[float, float]:
    """(roofline seconds, FLOPs) of one graph node on ``hardware``: views, getitems and
    placeholders cost nothing; a compute node the larger of its FLOPs at peak and the bytes it
    reads and writes at memory bandwidth."""
    if node.op != "call_function" or node.target == operator.getitem:
        return 0.0, 0.0
    ops = _view_ops()
    if ops.is_view(node):
        return 0.0, 0.0
    args: Any = _meta(node.args)
    kwargs: Any = _meta(dict(node.kwargs))
    out = node.meta.get("val")
    flops = 0.0
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None and packet in flop_registry:
        try:
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        except Exception:  # a formula that cannot read these (symbolic) shapes: count bytes only
            flops = 0.0
    traffic = sum(_nbytes(t) for t in _tensor_vals(args)) + sum(_nbytes(t) for t in _tensor_vals(out))
    return max(flops / _peak(hardware, out), traffic / hardware.memory_bytes_per_s), flops


def _peak(hardware: Hardware, out: Any) -> float:
    """The matmul peak in the dtype the node computes in (its first output's); fp32's where the
    hardware has no unit for that dtype (it would not have compiled to it)."""
    dtype = next((str(t.dtype).replace("torch.", "") for t in _tensor_vals(out)), "float32")
    try:
        return hardware.peak_flops_for(dtype)
    except HardwareError:
        return hardware.peak_flops


def graph_trace(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, hardware: Hardware, *,
                static_input_names: Sequence[str] = (), name: str = "compiled",
                taggable: frozenset[str] | None = None) -> GraphTrace:
    """The Trace of one partitioned graph pair (module docstring), timed by roofline for ``hardware``.
    ``taggable``: the joint graph's forward nodes, the ones a plan can tag (None: every node)."""
    ops = _view_ops()
    fw_nodes = list(fw.graph.nodes)
    pos = {n: i for i, n in enumerate(fw_nodes)}
    model_outputs = model_output_nodes(fw, num_fwd_outputs)
    placeholders = [n for n in fw_nodes if n.op == "placeholder"]
    static = {n for n in placeholders if n.name in set(static_input_names)}
    saved = [n for n in saved_nodes(fw, num_fwd_outputs) if n not in static]
    # the backward graph returns one gradient per forward input, None where it needs none
    grads = bw.graph.find_nodes(op="output")[0].args[0]
    needs_grad = {p for p, g in zip(placeholders, grads, strict=False) if g is not None} if len(grads) >= len(placeholders) else set()

    # R2: one tensor per storage. A saved view's storage is its base's; if the base is saved too,
    # offloading the base frees nothing while the view holds it, so the whole group stays.
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in saved:
        groups.setdefault(_base(n, ops), []).append(n)
    held: dict[str, str] = {}
    tensors: list[fx.Node] = []
    for members in groups.values():
        why = offloadable(members[0], model_outputs, static, ops, taggable, needs_grad) if len(members) == 1 else "shares its storage with another saved tensor"
        if why is None:
            tensors.append(members[0])
        else:
            for m in members:
                held[m.name] = why if m is members[0] else "shares its storage with another saved tensor"
    held_first = {base: members for base, members in groups.items() if members[0].name in held}

    # forward events: a pack at each tensor's producer, in graph order
    tensors.sort(key=lambda n: pos[n])
    tid = {n.name: k for k, n in enumerate(tensors)}
    fw_cost = [node_seconds(n, hardware) for n in fw_nodes]

    def last_forward_use(n: fx.Node) -> int:
        users = [pos[u] for u in n.users if u.op != "output"]
        stack = list(u for u in n.users if ops.is_view(u))
        while stack:  # a view's readers keep the storage too
            v = stack.pop()
            users += [pos[u] for u in v.users if u.op != "output"]
            stack += [u for u in v.users if ops.is_view(u)]
        return max(users, default=pos[n])

    events: list[Event] = []
    event_node: list[str] = []
    event_pos: list[int] = []
    since = 0
    for n in tensors:
        p = pos[n]
        gap = sum(c[0] for c in fw_cost[since:p + 1])
        flops = sum(c[1] for c in fw_cost[since:p + 1])
        since = p + 1
        events.append(Event("pack", tid[n.name], gap, flops))
        event_node.append(n.name)
        event_pos.append(p)
    fw_rest = sum(c[0] for c in fw_cost[since:])
    fw_rest_flops = sum(c[1] for c in fw_cost[since:])
    n_fwd = len(events)

    # backward events: an unpack at each node that reads a saved tensor
    bw_nodes = list(bw.graph.nodes)
    bpos = {n: i for i, n in enumerate(bw_nodes)}
    bw_cost = [node_seconds(n, hardware) for n in bw_nodes]
    bw_place = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    since = 0
    first = True
    for i, n in enumerate(bw_nodes):
        reads = [a.name for a in n.all_input_nodes if a.op == "placeholder" and a.name in tid]
        if not reads:
            continue
        gap = sum(c[0] for c in bw_cost[since:i])
        flops = sum(c[1] for c in bw_cost[since:i])
        if first:
            gap, flops, first = gap + fw_rest, flops + fw_rest_flops, False
        since = i
        for j, r in enumerate(dict.fromkeys(reads)):
            events.append(Event("unpack", tid[r], gap if j == 0 else 0.0, flops if j == 0 else 0.0))
            event_node.append(n.name)
            event_pos.append(len(fw_nodes) + i)
    tail = sum(c[0] for c in bw_cost[since:]) + (fw_rest if first else 0.0)
    tail_flops = sum(c[1] for c in bw_cost[since:]) + (fw_rest_flops if first else 0.0)

    # R2: the program holds each tensor through its last forward reader's gap
    fwd_event_pos = event_pos[:n_fwd]
    infos: list[TensorInfo] = []
    for k, n in enumerate(tensors):
        last = last_forward_use(n)
        rel = next((e for e in range(n_fwd) if fwd_event_pos[e] >= last), n_fwd if n_fwd < len(events) else None)
        first_reader = min((u for u in n.users if u.op != "output"), key=lambda u: pos[u], default=n)
        val = n.meta["val"]
        infos.append(TensorInfo(k, _nbytes(val), tuple(_hint(s) for s in val.shape), str(val.dtype).removeprefix("torch."),
                                _op_name(n), module_path(first_reader) or module_path(n),
                                released_at=rel if rel is not None and rel < len(events) else None))

    # R3: what torch cannot offload is live from its producer to its last backward reader
    other = [0] * len(events)
    for base, members in held_first.items():
        b = max(_nbytes(base.meta.get("val")), *(_nbytes(m.meta.get("val")) for m in members))
        start = pos.get(base, 0)
        readers = [bpos[u] for m in members if m.name in bw_place for u in bw_place[m.name].users]
        end = len(fw_nodes) + max(readers, default=-1)
        for e, p in enumerate(event_pos):
            if start <= p <= end:
                other[e] += b
    events = [Event(e.kind, e.tensor, e.compute_s, e.flops, other[i] or None) for i, e in enumerate(events)]

    # R9 under compile: a block whose forward mutates an input in place (BatchNorm's running
    # statistics) cannot be rebuilt in backward: the recompute would read the input after the
    # mutation, which autograd refuses (and checkpointing it in eager updates the stats twice)
    mutating = {module_path(n) for n in fw_nodes if n.op == "call_function" and _mutates_input(n)}
    static_bytes = 2 * sum(_nbytes(n.meta.get("val")) for n in static)  # parameters and their gradients
    trace = Trace(name=name, timing="roofline", device=hardware.name, static_bytes=static_bytes, tail_compute_s=tail,
                  tensors=tuple(infos), events=tuple(events),
                  meta={"executor": "compiled", "timing_source": "roofline of the graph's nodes", "tail_flops": tail_flops,
                        "held_bytes": sum(_nbytes(m[0].meta.get("val")) for m in held_first.values()),
                        "held": len(held),
                        # dynamic shapes: the sizes are symbolic, and the trace is at their hints
                        "symbolic": any(isinstance(d, torch.SymInt) for n in saved for d in n.meta["val"].shape)})
    if mutating:
        trace = trace.with_segments(lambda sg: not any(m == sg.name or m.startswith(sg.name + ".") for m in mutating))
    return GraphTrace(trace, tuple(n.name for n in tensors), tuple(event_node), held)


#: Ops whose functional form in a joint graph stands for an in-place update of a module's buffers
_MUTATING = ("_native_batch_norm_legit_functional", "native_batch_norm", "_batch_norm_with_update_functional",
             "_batch_norm_with_update", "batch_norm")


def _mutates_input(node: fx.Node) -> bool:
    name = _op_name(node)
    return name in _MUTATING or name.endswith("_")


def _op_name(node: fx.Node) -> str:
    """The aten op's name as the eager profiler records it (``addmm``), ``""`` for an input."""
    packet = getattr(node.target, "overloadpacket", None)
    return str(getattr(packet, "__name__", "")) if packet is not None else ""


def rebasable_views(fw: fx.GraphModule, num_fwd_outputs: int, taggable: frozenset[str]) -> dict[str, list[str]]:
    """Saved views whose storage torch could offload if the partition saved their base instead:
    base name -> the view nodes from it to each saved view (R10). A view is free to rebuild, so
    the partition may save the base (``MUST_SAVE``) and recompute the views in backward
    (``MUST_RECOMPUTE``): the saved bytes are the same storage, and the base is offloadable. A
    base qualifies when it is a forward op of the joint graph (not an input, not a ``getitem``),
    contiguous, not a model output and not saved itself."""
    ops = _view_ops()
    model_outputs = model_output_nodes(fw, num_fwd_outputs)
    saved = set(saved_nodes(fw, num_fwd_outputs))
    out: dict[str, list[str]] = {}
    for v in saved:
        if not ops.is_view(v):
            continue
        chain = []
        node = v
        while ops.is_view(node) and node.args and isinstance(node.args[0], fx.Node):
            chain.append(node.name)
            node = node.args[0]
        base = node
        if (base.op != "call_function" or base in saved or base in model_outputs or base.name not in taggable
                or offloadable(base, model_outputs, set(), ops, taggable) is not None):
            continue
        merge_chains(out, {base.name: chain})
    return out


#: Ops cheap enough to rebuild in backward rather than hold a tensor torch cannot offload: torch's
#: pointwise ops and these copies and joins (memory-bound: a few microseconds a megabyte on a GPU,
#: where the link takes a hundred), never a random one
_CHEAP = frozenset({"clone", "cat", "_to_copy", "contiguous", "neg"})
#: The most nodes rebuilt for one held tensor (rotary embeddings on q: about 20)
_MAX_REBUILT = 32


def _cheap(node: fx.Node) -> bool:
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return False
    return ((torch.Tag.pointwise in t.tags or t.overloadpacket.__name__ in _CHEAP)
            and torch.Tag.nondeterministic_seeded not in t.tags)


def recomputable_held(fw: fx.GraphModule, num_fwd_outputs: int, taggable: frozenset[str]) -> dict[str, list[str]]:
    """Saved tensors torch cannot offload because they are not contiguous (a pointwise op on a
    permuted view: rotary embeddings on q and k, a clone of v for attention), rebuilt in backward
    from offloadable bases instead (R10): base name -> the nodes to rebuild, as
    :func:`rebasable_views` gives them. From such a tensor back through cheap ops (views and
    :func:`_cheap` ones) of the joint graph's forward, each input ends at a graph input, a saved
    tensor torch can offload, or a base: a contiguous forward op that is no cheap op and no model
    output, saved (``MUST_SAVE``) in its place. A tensor whose inputs reach anything else (a
    multi-output op's ``getitem``, a random op) or more than ``_MAX_REBUILT`` nodes stays held."""
    ops = _view_ops()
    model_outputs = model_output_nodes(fw, num_fwd_outputs)
    saved = set(saved_nodes(fw, num_fwd_outputs))
    out: dict[str, list[str]] = {}
    for n in saved:
        val = n.meta.get("val")
        if (not isinstance(val, torch.Tensor) or val.is_contiguous() or ops.is_view(n) or not _cheap(n)
                or n.name not in taggable or n in model_outputs):
            continue
        rebuilt: list[str] = []
        bases: list[str] = []
        stack, seen = [n], set()
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if x is not n and (x.op == "placeholder" or (x in saved and offloadable(x, model_outputs, set(), ops, taggable) is None)):
                continue  # read as it is: an input, or a saved tensor that is offloaded or kept as planned
            movable = x.op == "call_function" and x.name in taggable and x not in model_outputs
            xv = x.meta.get("val")
            if (x is not n and movable and not ops.is_view(x) and not _cheap(x)
                    and isinstance(xv, torch.Tensor) and xv.is_contiguous()):
                bases.append(x.name)
                continue
            if not (movable and (ops.is_view(x) or _cheap(x))) or len(rebuilt) >= _MAX_REBUILT:
                bases = []
                break
            rebuilt.append(x.name)
            stack += x.all_input_nodes
        if bases:
            merge_chains(out, {bases[0]: rebuilt, **{b: [] for b in bases[1:]}})
    return out


def cloneable_getitems(fw: fx.GraphModule, num_fwd_outputs: int, taggable: frozenset[str]) -> list[str]:
    """``getitem``s of a multi-output op (dropout's output and mask, attention's output and
    log-sum-exp, layer norm's output) that are saved, or are the base of a saved view, and that
    torch would offload if the partition saved a clone of them instead (R10): contiguous tensors
    of the joint graph's forward, no model outputs. Torch refuses a ``getitem`` because the op's
    result tuple still reaches its storage, and a view of one cannot be rebased onto it; a clone
    is a storage of its own, at the roofline cost of one copy in forward."""
    ops = _view_ops()
    model_outputs = model_output_nodes(fw, num_fwd_outputs)
    out: list[str] = []
    for n in saved_nodes(fw, num_fwd_outputs):
        item = _base(n, ops)
        val = item.meta.get("val")
        if (item.op == "call_function" and item.target is operator.getitem and not ops.is_view(item)
                and item.name in taggable and item not in model_outputs and item.name not in out
                and isinstance(val, torch.Tensor) and val.is_contiguous()):
            out.append(item.name)
    return out
