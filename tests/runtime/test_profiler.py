"""runtime/profiler.py: tensors and bytes against an independent count, order, gradients, meta."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from swapsched.runtime.profiler import profile, static_bytes_of
from swapsched.runtime.recorder import ModulePath, OpNames, ProfileError, storage_key
from swapsched.zoo import build_model


def _independent(model, inputs, loss_fn):
    """Count saved storages with plain hooks: (kind, storage ptr) per call, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seq = []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seq.append(("pack", ptr, t.untyped_storage().nbytes()))
        return t

    def unpack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seq.append(("unpack", ptr, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss_fn(model(*inputs)).backward()
    model.zero_grad(set_to_none=True)
    ids = {}
    for _, ptr, _ in seq:
        ids.setdefault(ptr, len(ids))
    return [(k, ids[p]) for k, p, _ in seq], {ids[p]: b for _, p, b in seq}


def test_hand_counted_mlp():
    # Linear(8,16) saves x (2x8 fp32 = 64 B); ReLU saves its output (2x16 = 128 B), which Linear(16,4)
    # saves too: one storage, one tensor (R2). Weights are parameters. sum() saves nothing.
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    tr = profile(m, (torch.randn(2, 8),), lambda y: y.sum())
    assert [t.bytes for t in tr.tensors] == [64, 128]
    assert [(e.kind, e.tensor) for e in tr.events] == [("pack", 0), ("pack", 1), ("pack", 1), ("unpack", 1), ("unpack", 1), ("unpack", 0)]
    assert tr.static_bytes == 4 * (8 * 16 + 16 + 16 * 4 + 4)  # params; each gradient counts from its birth (R3)
    assert tr.timing == "measured" and all(e.compute_s >= 0 for e in tr.events)
    assert tr.tensors[1].op == "relu" and tr.tensors[0].op == "addmm"


def test_gradients_count_from_their_birth_without_the_state_and_as_static_with_it():
    """R3: Linear(16, 4)'s weight and bias gradients are born as its backward runs (in the gap
    before event 4, after the unpack of the ReLU's output), Linear(8, 16)'s in the last gap; each
    is an other byte from there to the step's end. With the state (R13) they are its bytes,
    static all step, beside the parameters and AdamW's two moments."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    second, first = 4 * (16 * 4 + 4), 4 * (8 * 16 + 16)
    tr = profile(m, (torch.randn(2, 8),), lambda y: y.sum())
    assert tr.meta["gradients_born"] == [[4, second], [5, first]]
    assert [e.other_bytes < second for e in tr.events[:4]] == [True] * 4
    assert tr.events[4].other_bytes >= second and tr.events[5].other_bytes >= second + first
    m.zero_grad(set_to_none=True)
    with_state = profile(m, (torch.randn(2, 8),), lambda y: y.sum(), state="adamw")
    assert with_state.static_bytes == 4 * (second + first) and "gradients_born" not in with_state.meta
    assert max(e.other_bytes for e in with_state.events) < second
    # ... which the step makes: the state's gradients count from their groups' backward (R13)
    assert with_state.state_gradients_born and with_state.meta["state_gradients_born"] is True
    # a step that begins with gradients (accumulating) adds into them: none is born, all static
    accumulating = profile(m, (torch.randn(2, 8),), lambda y: y.sum())
    assert accumulating.static_bytes == 2 * (second + first) and accumulating.meta["gradients_born"] == []
    assert not profile(m, (torch.randn(2, 8),), lambda y: y.sum(), state="adamw").state_gradients_born


@pytest.mark.parametrize("family", ["mlp", "vgg", "resnet", "gpt", "bert", "unet"])
def test_zoo_models_match_independent_count_and_order(family):
    case = build_model(family, "tiny")
    order, sizes = _independent(case.model, case.inputs, case.loss_fn)
    tr = profile(case.model, case.inputs, case.loss_fn, name=case.name)
    assert tr.n_tensors == len(sizes)
    assert sorted(t.bytes for t in tr.tensors) == sorted(sizes.values())
    assert [(e.kind, e.tensor) for e in tr.events] == order


@pytest.mark.parametrize("family", ["mlp", "resnet", "gpt"])
def test_gradients_unchanged_by_profiling(family):
    a = build_model(family, "tiny", seed=3)
    b = build_model(family, "tiny", seed=3)
    if family == "gpt":  # dropout-free zoo; add randomness to check the RNG is restored
        a.model.blocks[0].mlp.insert(1, nn.Dropout(0.5))
        b.model.blocks[0].mlp.insert(1, nn.Dropout(0.5))
    torch.manual_seed(7)
    profile(a.model, a.inputs, a.loss_fn)
    torch.manual_seed(7)
    b.loss().backward()
    for (n, pa), pb in zip(a.model.named_parameters(), b.model.parameters(), strict=False):
        assert torch.equal(pa.grad, pb.grad), n
    for ba, bb in zip(a.model.buffers(), b.model.buffers(), strict=False):  # BatchNorm statistics: one step's worth
        assert torch.equal(ba, bb)


def test_optimizer_state_counts_in_static_bytes():
    m = nn.Linear(10, 10)
    p_bytes = 4 * (100 + 10)
    assert static_bytes_of(m) == 2 * p_bytes
    assert static_bytes_of(m, torch.optim.Adam(m.parameters())) == 4 * p_bytes
    assert static_bytes_of(m, torch.optim.SGD(m.parameters(), lr=0.1)) == 2 * p_bytes


def test_meta_profile_of_a_1b_gpt_is_fast_and_roofline():
    t0 = time.perf_counter()
    case = build_model("gpt", "1.3b", device="meta")
    assert sum(p.numel() for p in case.model.parameters()) > 1e9
    tr = profile(case.model, case.inputs, case.loss_fn, device="meta", name=case.name, hardware="h100-pcie5")
    assert time.perf_counter() - t0 < 60
    assert tr.timing == "roofline" and tr.saved_bytes_peak > 10 * 2**30 and tr.ideal_s > 0
    assert all(e.flops is not None for e in tr.events)


def test_cpu_trace_retimed_for_a_gpu():
    case = build_model("mlp", "tiny")
    tr = profile(case.model, case.inputs, case.loss_fn, hardware="a100-pcie4")
    assert tr.timing == "roofline" and tr.device == "a100-pcie4" and tr.ideal_s < 1e-3


def test_step_without_saved_tensors_is_an_error():
    m = nn.Linear(4, 4)
    with pytest.raises(ProfileError, match="saved no tensors"):
        profile(m, (torch.randn(2, 4),), lambda y: y.detach().sum() + m.bias.sum())


def test_op_names_count_each_op_call_per_module_as_selective_checkpointing_does():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = torch.relu(self.fc1(x))
            return self.fc2(h).view(-1)  # a view makes no new storage

    model = nn.Sequential(Block(), Block())
    x = torch.randn(4, 8)
    with ModulePath(model) as modules, OpNames(modules) as ops:
        out = model[1](model[0](x).view(4, 8))
    produced = {storage_key(out): ops.producers[storage_key(out)]}
    # the output storage is the second block's second addmm: its 1st call there (0-based), the 0th in fc2
    addmm = torch.ops.aten.addmm.default
    assert produced[storage_key(out)] == (("1", addmm, 1), ("1.fc2", addmm, 0))
    # each module call counts afresh: the first block's relu is its 0th relu, and so is the second's
    relus = sorted(v for v in ops.producers.values() if any(op is torch.ops.aten.relu.default for _, op, _ in v))
    assert relus == [(("0", torch.ops.aten.relu.default, 0),), (("1", torch.ops.aten.relu.default, 0),)]
    assert all(op is not torch.ops.aten.view.default for v in ops.producers.values() for _, op, _ in v)
