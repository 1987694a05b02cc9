"""compiled/graph_trace.py: a partitioned graph pair read as a Trace (R1/R2/R3, R10)."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from swapsched.compiled.graph_trace import graph_trace, module_path
from swapsched.hardware import Hardware
from tests.compiled.conftest import make_case

HW = Hardware(name="round", d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, copy_latency_s=0.0, device_memory_bytes=10**10,
              peak_flops=1e12, memory_bytes_per_s=1e11)


def partition_of(model: nn.Module, *inputs: Any) -> list[tuple[fx.GraphModule, fx.GraphModule, int, list[str]]]:
    """Every (forward, backward, model outputs, static input names) torch's partitioner makes of ``model``."""
    got = []

    def part(joint: fx.GraphModule, joint_inputs: Any, **kw: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        names = [n.name for n in joint.graph.nodes if n.op == "placeholder"]
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kw)
        got.append((fw, bw, kw["num_fwd_outputs"], [names[i] for i in kw.get("static_lifetime_input_indices") or []]))
        return fw, bw

    def nop(g: fx.GraphModule, _: Any) -> Any:
        return make_boxed_func(g.forward)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=part))
    compiled(*inputs).backward()
    return got


class ViewAndTranspose(nn.Module):
    """Saves views (the matmul's transposed operands) and non-contiguous tensors (``u``, a pointwise
    op's output on a transposed input, and its sigmoid)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sin(x @ self.w)           # sin saves x @ w: contiguous, offloadable
        u = torch.cos(y.t())                # non-contiguous (it keeps the transpose's strides)
        v = u * torch.sigmoid(u)            # mul saves u and sigmoid(u): non-contiguous
        return v.sum() + torch.exp(y.view(64)).sum()


def test_the_planner_sees_only_what_torch_can_offload():
    ((fw, bw, n_out, static),) = partition_of(ViewAndTranspose(), torch.randn(8, 8))
    gt = graph_trace(fw, bw, n_out, HW, static_input_names=static)
    names = set(gt.node_of)
    assert not names & set(gt.held)
    # every held tensor is one torch's can_offload refuses, for the reason given
    for name, why in gt.held.items():
        node = next(n for n in fw.graph.nodes if n.name == name)
        if why == "non-contiguous":
            assert not node.meta["val"].is_contiguous()
    assert {"non-contiguous", "a view"} <= set(gt.held.values())
    assert all(next(n for n in fw.graph.nodes if n.name == m).meta["val"].is_contiguous() for m in names)
    # the held bytes are other_bytes (R3) of the gaps they are live in: sigmoid's 256 B and the
    # two views' (detach_2 of exp, t_2 of the input), 768 B in all; at most two are live at one event
    held_bytes = gt.trace.meta["held_bytes"]
    assert held_bytes == 768 and gt.trace.other_bytes.tolist() == [256, 512, 256]


def test_aliasing_ops_and_getitems_of_views_are_views():
    """transpose and detach are not on the partitioner's view list, yet alias their input; a
    getitem of split's outputs is a view of split's input (R10: held, or rebased onto the base)."""
    from swapsched.compiled.graph_trace import _view_ops

    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = (x @ self.w).split(4, dim=1)
            return (torch.sin(a.transpose(0, 1)).sum() + (b.detach() * a).sum())

    ((fw, _, _, _),) = partition_of(Split(), torch.randn(8, 8))
    views = _view_ops()
    kinds = {}
    for n in fw.graph.nodes:
        if n.op == "call_function":
            src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            key = f"getitem of {src.target.__name__}" if n.target is operator.getitem else n.target.__name__
            kinds.setdefault(key, set()).add(views.is_view(n))
    assert kinds["getitem of split.Tensor"] == {True} and kinds["transpose.int"] == {True}
    assert kinds["mm.default"] == {False} and kinds["sin.default"] == {False}


def test_bytes_and_events_follow_the_graphs():
    model, x = make_case("mlp")
    ((fw, bw, n_out, static),) = partition_of(model, x)
    gt = graph_trace(fw, bw, n_out, HW, static_input_names=static)
    t = gt.trace
    by_name = {n.name: n for n in fw.graph.nodes}
    for k, name in enumerate(gt.node_of):
        val = by_name[name].meta["val"]
        assert t.tensors[k].bytes == val.numel() * val.element_size()
    # packs in forward graph order, then unpacks: each read of a saved placeholder in backward
    order = [n.name for n in fw.graph.nodes]
    packs = [gt.event_node[i] for i in range(t.backward_start)]
    assert packs == sorted(packs, key=order.index) and packs == list(gt.node_of)
    reads = sum(1 for n in bw.graph.nodes for a in dict.fromkeys(n.all_input_nodes) if a.name in set(gt.node_of))
    assert t.n_events - t.backward_start == reads
    # parameters (and their gradients) are static, never saved tensors (R2)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert t.static_bytes == 2 * params
    # gaps: roofline, so the ideal step is positive and the trace says where times came from
    assert t.ideal_s > 0 and t.timing == "roofline" and t.meta["executor"] == "compiled"


def test_blocks_come_from_the_module_stack():
    model, x = make_case("mlp")
    ((fw, bw, n_out, static),) = partition_of(model, x)
    t = graph_trace(fw, bw, n_out, HW, static_input_names=static).trace
    # blocks.0's input is the caller's batch, held (a graph input), so its first saved tensor
    # is inside it and the block may not qualify (R9); the later blocks' anchors are the
    # residual stream their first op saves
    names = [s.name for s in t.segments]
    assert {"blocks.1", "blocks.2"} <= set(names) <= {"blocks.0", "blocks.1", "blocks.2"}
    for s in t.segments:
        assert all(t.tensors[k].module.startswith(s.name + ".") or t.tensors[k].module == s.name for k in (s.anchor, *s.members))


@pytest.mark.parametrize(("path", "want"), [
    ("L['self'].blocks.3.attn", "blocks.3.attn"),
    ("L['self'].blocks[3].attn", "blocks.3.attn"),
    ("L['self']._modules['blocks']['3']", "blocks.3"),
    ("L['self']", ""),
])
def test_module_path(path, want):
    g = fx.Graph()
    n = g.placeholder("x")
    n.meta["nn_module_stack"] = {"k": (path, nn.Module)}
    assert module_path(n) == want


def test_a_saved_view_of_an_offloadable_base_is_rebased():
    # each fc2 reads a view of gelu's output, and the head a view of the last residual add; torch
    # saves those views, which it cannot offload. rebasable_views names the gelus and the add as
    # the bases to save instead, with the views to rebuild
    from swapsched.compiled.graph_trace import rebasable_views

    model, x = make_case("mlp")
    ((fw, bw, n_out, static),) = partition_of(model, x)
    joint_like = frozenset(n.name for n in fw.graph.nodes if n.op == "call_function")
    rebase = rebasable_views(fw, n_out, joint_like)
    by_name = {n.name: n for n in fw.graph.nodes}
    assert sorted(str(by_name[b].target) for b in rebase) == ["aten.add.Tensor"] + ["aten.gelu.default"] * 3
    for base, chain in rebase.items():
        assert chain and all(by_name[v].target == torch.ops.aten.view.default for v in chain)
        assert by_name[chain[-1]].args[0] is by_name[base]
    # a base that is not a joint-graph node cannot be tagged: nothing to rebase
    assert rebasable_views(fw, n_out, frozenset()) == {}


def test_a_non_contiguous_pointwise_tensor_is_rebuilt_from_an_offloadable_base():
    """``u = sin(q)`` on a permuted view ``q`` of ``x @ w`` keeps q's strides, and so does
    ``exp(u)``, which the partition saves beside q (it rebuilds u from q): torch cannot offload
    it (non-contiguous). It is rebuilt in backward from ``x @ w`` (contiguous, offloadable): the
    base to save, with exp, sin and the views between to rebuild (R10)."""
    from swapsched.compiled.graph_trace import recomputable_held

    class Rotated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = (x @ self.w).view(8, 4, 4).transpose(0, 1)
            u = torch.sin(q)
            return (u * u.exp()).sum()

    ((fw, bw, n_out, static),) = partition_of(Rotated(), torch.randn(8, 8))
    forward = frozenset(n.name for n in fw.graph.nodes if n.op == "call_function")
    gt = graph_trace(fw, bw, n_out, HW, static_input_names=static)
    assert gt.held["exp"] == "non-contiguous" and gt.held["transpose"] == "a view"
    got = recomputable_held(fw, n_out, forward)
    assert set(got) == {"mm"} and {"exp", "sin", "transpose", "view"} <= set(got["mm"]) and "mm" not in got["mm"]


def test_saved_getitems_of_a_multi_output_op_are_to_be_cloned():
    """Dropout's output (its transpose saved by the matmul after it) and its mask (saved by
    dropout's backward) are ``getitem``s of ``native_dropout``: held, and named to be saved
    through a clone. Layer
    norm's mean and rstd likewise, and its output, the base of the saved ``split`` view the
    matmul reads (a getitem of a view op is a view, rebased onto the clone once it exists)."""
    from swapsched.compiled.graph_trace import cloneable_getitems

    class Dropped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w, self.ln = nn.Parameter(torch.randn(8, 8)), nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = self.ln(x).split(4, dim=1)
            d = torch.nn.functional.dropout(torch.tanh(a @ self.w[:4]), 0.3, training=True)
            return (d @ self.w).square().sum() + b.exp().sum()

    ((fw, bw, n_out, static),) = partition_of(Dropped(), torch.randn(8, 8))
    forward = frozenset(n.name for n in fw.graph.nodes if n.op == "call_function")
    gt = graph_trace(fw, bw, n_out, HW, static_input_names=static)
    by_name = {n.name: n for n in fw.graph.nodes}
    got = cloneable_getitems(fw, n_out, forward)
    sources = sorted(str(by_name[n].args[0].target) for n in got)
    assert sources == ["aten.native_dropout.default"] * 2 + ["aten.native_layer_norm.default"] * 3, sources
    # the mask, mean and rstd are held themselves; the two outputs through the views saved of them
    assert sum(gt.held.get(n) == "a getitem" for n in got) == 3
    assert cloneable_getitems(fw, n_out, frozenset()) == []  # not joint-graph nodes: nothing to tag
