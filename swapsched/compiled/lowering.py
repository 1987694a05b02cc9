"""A SwapPlan lowered into a compiled graph pair (DESIGN.md, R10).

The plan is made on the graphs the partitioner chose with no tags (:mod:`graph_trace`); lowering
tags the joint graph and partitions it again:

- an evicted tensor's node gets ``meta["should_offload"]``, and torch's activation offloading
  (``torch._functorch.config.enable_activation_offloading``) inserts its offload and reload;
- a recomputed block's forward nodes get ``CheckpointPolicy.MUST_RECOMPUTE`` and its anchor
  ``MUST_SAVE`` (R9): the partitioner then rebuilds the block in backward from its anchor, as
  checkpointing the block does; a selective block keeps (``MUST_SAVE``) the outputs of the ops
  selective checkpointing saves (``trace.SELECTIVE_SAVE_OPS``) and recomputes the rest;
- then the offload of each evicted tensor moves to the plan's swap-out event (never before its
  producer) and its reload to the plan's prefetch event (R7), where torch would put them after
  the last forward use and before the first backward use. The wait on a reload stays before the
  first use; the wait on an offload stays after the last forward use (its ``keepalive`` frees
  the device copy there, R2).

:func:`lowered_decisions` reads back what a lowered graph pair holds, so a test (and the
backend's report) can check that it holds exactly the plan.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from swapsched.compiled.graph_trace import GraphTrace, module_path
from swapsched.plan import SwapPlan
from swapsched.segments import SELECTIVE_SAVE_OPS

__all__ = ["Lowered", "rebase_views", "clone_getitems", "kept_clones", "unclone", "tag_joint", "place_copies", "lowered_decisions", "OFFLOAD_PREFIXES", "RELOAD_PREFIXES"]

#: Names torch gives the nodes it inserts (torch/_functorch/_activation_offloading): the
#: synchronous ``device_put`` lowering and the ``ao.offload`` / ``ao.reload`` one on a stream
OFFLOAD_PREFIXES = ("async_cpu_offload_", "cpu_offload_")
RELOAD_PREFIXES = ("async_gpu_reload_", "gpu_reload_")


@dataclass(frozen=True)
class Lowered:
    """What a lowered graph pair holds: the offloaded saved tensors (forward node names); per
    offloaded tensor, the backward node its reload is issued before; and the forward nodes the
    backward graph recomputes."""

    offloaded: frozenset[str]
    reload_before: dict[str, str]
    offload_after: dict[str, str]
    recomputed: frozenset[str]
    saved: frozenset[str]
    bw_order: tuple[str, ...]
    placeholders: frozenset[str]


def _stripped(name: str, prefixes: tuple[str, ...]) -> str | None:
    for p in prefixes:
        if name.startswith(p):
            return name[len(p):]
    return None


def _recomputed_members(gt: GraphTrace, plan: SwapPlan) -> dict[str, str]:
    """The forward nodes of the tensors ``plan``'s recomputed blocks (whole or selective) hold:
    node name -> block name."""
    names = {*plan.recompute, *plan.selective}
    return {gt.node_of[k]: s.name for s in gt.trace.segments if s.name in names for k in s.members}


def _block_of(node: fx.Node, members: dict[str, str], blocks: tuple[str, ...]) -> str | None:
    """The recomputed block (of ``blocks``) ``node`` is in: its tensor's (``members``), else the
    one whose module runs it, by the node's module path."""
    if node.name in members:
        return members[node.name]
    path = module_path(node)
    return next((b for b in blocks if path == b or path.startswith(b + ".")), None)


def tag_joint(joint: fx.GraphModule, gt: GraphTrace, plan: SwapPlan, forward_nodes: frozenset[str]) -> tuple[int, int]:
    """Tag ``joint`` with ``plan``'s decisions (module docstring). Returns (offload tags,
    recompute tags)."""
    evicted = {gt.node_of[e.tensor] for e in plan.evictions}
    by_name = {s.name: s for s in gt.trace.segments}
    blocks = (*plan.recompute, *plan.selective)
    anchors = {gt.node_of[by_name[b].anchor] for b in blocks}
    members = _recomputed_members(gt, plan)
    sel_names = set(plan.selective)

    # where the plan recomputes, the tags pin the rest of the partition too: with any tag set the
    # min-cut partitioner re-decides untagged nodes, and could then rebuild a tensor the plan swaps
    keep = ({*gt.node_of, *gt.held} - set(members)) if members or gt.rebased or gt.uncloned else set()
    keep = {gt.uncloned.get(n, n) for n in keep}  # a kept clone taken out: its getitem is saved
    n_off = n_rec = 0
    for node in joint.graph.nodes:
        if node.op == "placeholder" and node.name in evicted:  # an activation of the graph before
            node.meta["should_offload"] = True
            n_off += 1
            continue
        if node.op != "call_function" or node.name not in forward_nodes:
            continue
        if node.name in evicted:
            node.meta["should_offload"] = True
            n_off += 1
        if node.name in anchors or node.name in keep:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            continue
        block = _block_of(node, members, blocks)
        if block is None:
            continue
        op = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
        # a getitem names no op, and the trace counts such a tensor saved (R9, selective): saved
        # here too. Tagged to be rebuilt, the getitems of a saved multi-output op (SDPA's output
        # and log-sum-exp) left the partitioner a tuple to save, which it cannot (HF Llama at 50%)
        if block in sel_names and (op in SELECTIVE_SAVE_OPS or node.target is operator.getitem):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        else:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n_rec += 1
    return n_off, n_rec


def rebase_views(joint: fx.GraphModule, rebase: dict[str, list[str]], saved: set[str], forward_nodes: frozenset[str]) -> None:
    """Tag ``joint`` so that its partition saves each base in ``rebase`` instead of the views of
    it that were saved, and rebuilds those views in backward (``graph_trace.rebasable_views``;
    also the cheap ops between a base and a non-contiguous saved tensor,
    ``graph_trace.recomputable_held``).
    Every other saved tensor is pinned (``MUST_SAVE``): with any tag set the min-cut partitioner
    re-decides untagged nodes."""
    views = {v for chain in rebase.values() for v in chain}
    for node in joint.graph.nodes:
        if node.op != "call_function":
            continue
        if node.name in views:
            # a view of the joint graph's backward that reads forward values only (a transpose
            # for a matmul's gradient): the partitioner computes it in forward and may save it in
            # place of its base unless it is told to rebuild it in backward too
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        elif node.name not in forward_nodes:
            continue
        elif node.name in rebase or node.name in saved:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def clone_getitems(joint: fx.GraphModule, names: list[str]) -> dict[str, str]:
    """Put a clone after each named ``getitem`` of ``joint``'s forward and let every reader of the
    ``getitem`` read the clone (``graph_trace.cloneable_getitems``), so the partition saves the
    clone, which torch can offload. The clone is tagged ``MUST_SAVE`` (the partitioner would
    otherwise rebuild it in backward from the ``getitem``, saving that again). Returns each
    clone's name -> its ``getitem``'s. A clone copies the values exactly: training is unchanged."""
    by_name = {n.name: n for n in joint.graph.nodes}
    made = {}
    for name in names:
        item = by_name[name]
        val = item.meta["val"]
        with joint.graph.inserting_after(item):
            clone = joint.graph.call_function(torch.ops.aten.clone.default, (item,))
        item.replace_all_uses_with(clone, delete_user_cb=lambda user, clone=clone: user is not clone)
        clone.meta.update({k: v for k, v in item.meta.items() if k not in ("val", "tensor_meta")})
        with val.fake_mode:  # the partitioner sizes and places nodes by their fake tensors
            clone.meta["val"] = torch.ops.aten.clone.default(val)
        clone.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        made[clone.name] = name
    joint.graph.lint()
    joint.recompile()
    return made


def kept_clones(joint: fx.GraphModule, gt: GraphTrace, plan: SwapPlan, clones: dict[str, str]) -> dict[str, str]:
    """The clones of :func:`clone_getitems` (clone -> getitem) that ``plan`` keeps on the device:
    not offloaded, and neither they nor their getitem in a block the plan recomputes (where the
    multi-output op is rebuilt, its getitems with it, and the clone is what backward reads)."""
    blocks = (*plan.recompute, *plan.selective)
    evicted = {gt.node_of[e.tensor] for e in plan.evictions}
    members = _recomputed_members(gt, plan)
    by_name = {n.name: n for n in joint.graph.nodes}
    return {c: item for c, item in clones.items() if c not in evicted
            and _block_of(by_name[c], members, blocks) is None and _block_of(by_name[item], members, blocks) is None}


def unclone(joint: fx.GraphModule, clones: dict[str, str]) -> None:
    """Take out the named clones of :func:`clone_getitems` that a plan neither offloads nor
    recomputes: their readers read the ``getitem`` again, which the partition saves
    (``MUST_SAVE``). A kept clone would cost a copy in forward for nothing; its bytes are on the
    device either way."""
    by_name = {n.name: n for n in joint.graph.nodes}
    for name, item_name in clones.items():
        clone, item = by_name[name], by_name[item_name]
        clone.replace_all_uses_with(item)
        joint.graph.erase_node(clone)
        item.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    joint.graph.lint()
    joint.recompile()


def _by_suffix(graph: fx.Graph, prefixes: tuple[str, ...]) -> dict[str, fx.Node]:
    out = {}
    for n in graph.nodes:
        base = _stripped(n.name, prefixes)
        if base is not None and n.op == "call_function" and not _is_wait(n):
            out[base] = n
    return out


def place_copies(fw: fx.GraphModule, bw: fx.GraphModule, gt: GraphTrace, plan: SwapPlan) -> None:
    """Move each offload to the plan's swap-out event and each reload to its prefetch event (R7)."""
    offloads = _by_suffix(fw.graph, OFFLOAD_PREFIXES)
    reloads = _by_suffix(bw.graph, RELOAD_PREFIXES)
    fw_by_name = {n.name: n for n in fw.graph.nodes}
    bw_by_name = {n.name: n for n in bw.graph.nodes}
    fw_pos = {n: i for i, n in enumerate(fw.graph.nodes)}
    bw_pos = {n: i for i, n in enumerate(bw.graph.nodes)}
    trace = gt.trace
    # as backward starts: before its first node of compute, found before any reload moves (the
    # positions above are those of the graph as torch left it; a moved reload's is stale)
    start = next((n for n in bw.graph.nodes if n.op != "placeholder" and n not in reloads.values() and not _is_wait(n)), None)
    for e in plan.evictions:
        name = gt.node_of[e.tensor]
        off = offloads.get(name)
        if off is not None:
            # the offload reads the tensor: never before its producer, and at the plan's event
            at = fw_by_name.get(gt.event_node[e.swap_out_at])
            producer = fw_by_name.get(name)
            anchor = max((n for n in (at, producer) if n is not None), key=lambda n: fw_pos[n], default=None)
            if anchor is not None and fw_pos[anchor] < fw_pos[off]:
                anchor.append(off)
        rel = reloads.get(name)
        if rel is not None and e.prefetch_at < int(trace.first_unpack[e.tensor]):
            # a prefetch planned in forward is issued as backward starts: the reload is the
            # backward graph's, which runs only then (R10)
            target = bw_by_name.get(gt.event_node[e.prefetch_at]) if e.prefetch_at >= trace.backward_start else start
            # a reload reads only its placeholder: it may go anywhere after the placeholders, and
            # never after its first use (a recompute may read the tensor before the event's node)
            if target is not None and target.op != "placeholder" and bw_pos[target] < bw_pos[rel]:
                target.prepend(rel)
    fw.graph.lint()
    bw.graph.lint()
    fw.recompile()
    bw.recompile()


def lowered_decisions(fw: fx.GraphModule, bw: fx.GraphModule, forward_nodes: frozenset[str],
                      num_fwd_outputs: int) -> Lowered:
    """Read back what a lowered graph pair does (module docstring)."""
    offloads = _by_suffix(fw.graph, OFFLOAD_PREFIXES)
    reloads = _by_suffix(bw.graph, RELOAD_PREFIXES)
    order = list(bw.graph.nodes)
    reload_before: dict[str, str] = {}
    for name, rel in reloads.items():
        i = order.index(rel) + 1
        while i < len(order) and (_stripped(order[i].name, RELOAD_PREFIXES) is not None or order[i].op == "placeholder"
                                  or _is_wait(order[i])):
            i += 1
        reload_before[name] = order[i].name if i < len(order) else "output"
    fw_order = list(fw.graph.nodes)
    offload_after = {}
    for name, off in offloads.items():
        i = fw_order.index(off) - 1
        while i > 0 and _stripped(fw_order[i].name, OFFLOAD_PREFIXES) is not None:
            i -= 1
        offload_after[name] = fw_order[i].name
    recomputed = frozenset(n.name for n in bw.graph.nodes if n.op == "call_function" and n.name in forward_nodes)
    outs = fw.graph.find_nodes(op="output")[0].args[0]
    saved = frozenset(n.name for n in outs[num_fwd_outputs:] if isinstance(n, fx.Node))
    return Lowered(frozenset(offloads), reload_before, offload_after, recomputed, saved, tuple(n.name for n in order),
                   frozenset(n.name for n in order if n.op == "placeholder"))


def _is_wait(node: fx.Node) -> bool:
    return "wait_tensor" in str(node.target)
