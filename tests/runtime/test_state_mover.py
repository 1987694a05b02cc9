"""The state mover (runtime/state_mover.py): every placement trains bit-identically to the plain
loop under what users do between backward and step, the state really leaves the device, a fault
leaves everything readable, and bad input is refused before anything moves."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

from swapsched.errors import UserError
from swapsched.runtime.backends import CpuBackend
from swapsched.runtime.state_mover import StateMover

MOVING = ("param", "host-step", "stream", "full", "stream-full")
VOCAB, WIDTH = 40, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TiedLM(nn.Module):
    """Embedding, three blocks, and a head that shares the embedding's weight (weight tying)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())


class Harness:
    """A step under the mover as the runtime runs one: ``begin_step``, the unpack hook telling it
    where backward is, ``end_step`` (whatever happens)."""

    def __init__(self, mover: StateMover | None):
        self.mover = mover

    def step(self, fn: Callable[[], Any]) -> Any:
        mover = self.mover
        if mover is None:
            return fn()
        mover.begin_step()
        try:
            def unpack(t: torch.Tensor) -> torch.Tensor:
                mover.at_unpack(10**9, t)  # every group reached: the guard on kept storages decides
                return t

            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
                return fn()
        finally:
            mover.end_step()

    def train_step(self, model: nn.Module, x: torch.Tensor, micro: int = 1) -> float:
        """Forward and backward of ``model`` on ``x`` as one of ``micro`` micro-batches: the loss."""
        def fwd_bwd() -> float:
            loss = _loss(model, x) / micro
            loss.backward()
            return loss.item()

        return self.step(fwd_bwd)


def _optimizer(model: nn.Module, variant: str) -> torch.optim.Optimizer:
    if variant == "param-groups":  # the blocks with another lr and no weight decay
        blocks = list(model.layers.parameters())
        others = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
        return torch.optim.AdamW([{"params": others}, {"params": blocks, "lr": 3e-3, "weight_decay": 0.0}], lr=1e-2)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(placement: dict[str, str] | None, variant: str = "clip", steps: int = 10, disk: Any = None) -> dict[str, Any]:
    """``steps`` optimizer steps of :class:`TiedLM` in the loop ``variant`` names, under a mover
    with ``placement`` (None: the plain loop) and ``disk`` (R19: its store and tiers); what a
    user can read after it."""
    torch.manual_seed(0)
    model = TiedLM()
    opt = _optimizer(model, variant)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if variant == "scheduler" else None
    backend = CpuBackend()
    mover = StateMover(model, opt, backend, (), placement, disk=disk) if placement else None
    h = Harness(mover)
    gen = torch.Generator().manual_seed(1)
    losses, evals = [], []
    micro = 2 if variant == "accumulate" else 1
    try:
        for step in range(steps):
            for _ in range(micro):
                losses.append(h.train_step(model, torch.randint(0, VOCAB, (4, 6), generator=gen), micro))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
            if variant == "eval-between":
                model.eval()
                with torch.no_grad():
                    evals.append(_loss(model, torch.arange(12).view(2, 6) % VOCAB).item())
                model.train()
            if variant == "state-dict" and step == 4:
                # saved and reloaded mid-run, through bytes, as a checkpoint would be
                saved = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
                saved.seek(0)
                ckpt = torch.load(saved)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)  # clobbered, so that only the reload can make the run continue right
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["opt"])
        if disk is not None:
            opt.state_dict()  # R19: as a checkpoint reads it, the state resting on the disk back first
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
        return {"losses": losses, "evals": evals, "params": params, "state": state, "mover": mover, "model": model}
    finally:
        if mover is not None:
            mover.remove()
        backend.shutdown()


def assert_same_run(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"]
    assert a["evals"] == b["evals"]
    for n, p in a["params"].items():
        assert torch.equal(p, b["params"][n]), n
    for n, st in a["state"].items():
        assert st.keys() == b["state"][n].keys(), n
        for k, v in st.items():
            assert torch.equal(v, b["state"][n][k]), (n, k)


def _placement(where: str) -> dict[str, str]:
    # the tied weight's owner (emb) moves, the head that shares it stays: its uses fetch it too
    return {"emb": where, "layers.0": where, "layers.2": where, "layers.1": "device"}


@pytest.fixture(scope="module")
def plain_runs() -> dict[str, dict[str, Any]]:
    return {}


@pytest.mark.parametrize("variant", ["clip", "accumulate", "scheduler", "param-groups", "eval-between", "state-dict"])
@pytest.mark.parametrize("where", MOVING)
def test_every_placement_trains_bit_identically(where: str, variant: str, plain_runs: dict[str, dict[str, Any]]) -> None:
    if variant not in plain_runs:
        plain_runs[variant] = train(None, variant)
    moved = train(_placement(where), variant)
    assert_same_run(moved, plain_runs[variant])
    assert moved["mover"].copied > 0  # it moved something: not a mover that does nothing


def _after_forward_bytes(where: str) -> tuple[int, int, int]:
    """(layers.0.up.weight's device storage bytes after the block's forward, its bytes, the
    optimizer state bytes on the device at rest) under ``where``."""
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backend = CpuBackend()
    mover = StateMover(model, opt, backend, (), {"layers.0": where})
    seen: list[int] = []
    mp = mover.params[id(model.layers[0].up.weight)]

    def look(module: nn.Module, args: Any) -> None:
        # param: let go once its copy out lands (it may still be on its way)
        in_flight = mp.out is not None and mp.out_release
        seen.append(0 if mp.dev is None or in_flight else mp.dev.untyped_storage().nbytes())

    model.layers[1].register_forward_pre_hook(look)
    h = Harness(mover)
    x = torch.randint(0, VOCAB, (4, 6))
    for _ in range(2):
        h.step(lambda: _loss(model, x).backward())
        opt.step()
        opt.zero_grad()
    mover.settle()
    w = model.layers[0].up.weight
    out = (seen[-1], w.numel() * w.element_size(), mover.measured_device_bytes())
    mover.remove()
    backend.shutdown()
    return out


@pytest.mark.parametrize("where", ["param", "full", "stream-full"])
def test_a_released_parameter_holds_no_device_bytes_between_uses(where: str) -> None:
    after_forward, nbytes, at_rest = _after_forward_bytes(where)
    assert nbytes > 0 and after_forward == 0
    # at rest: param's parameter is back on the device (R14), the others hold nothing there
    assert at_rest == (4 * WIDTH * 2 * WIDTH + 4 * 2 * WIDTH + 4 * WIDTH * 2 * WIDTH + 4 * WIDTH + 8 * WIDTH
                       if where == "param" else 0)


def test_host_placements_leave_the_parameter_and_gradient_on_the_host_at_rest() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backend = CpuBackend()
    mover = StateMover(model, opt, backend, (), {"layers.0": "host-step", "layers.2": "full"})
    h = Harness(mover)
    h.step(lambda: _loss(model, torch.randint(0, VOCAB, (4, 6))).backward())
    for name in ("layers.0.up.weight", "layers.2.up.weight"):
        p = dict(model.named_parameters())[name]
        mp = mover.params[id(p)]
        assert p.data.data_ptr() == mp.host.data_ptr()  # the host master is what the user reads
        assert p.grad is mp.hgrad and p.grad is not None
    # host-step keeps its device copy; full has none between steps
    assert mover.params[id(model.layers[0].up.weight)].dev is not None
    assert mover.params[id(model.layers[2].up.weight)].dev is None
    assert mover.transient == 0 and mover.measured_device_bytes() == 0
    mover.remove()
    backend.shutdown()


def test_a_fault_inside_the_step_leaves_everything_readable_and_the_next_step_runs() -> None:
    def run(placement: dict[str, str] | None) -> dict[str, Any]:
        torch.manual_seed(0)
        model = TiedLM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        backend = CpuBackend()
        mover = StateMover(model, opt, backend, (), placement) if placement else None
        h = Harness(mover)
        gen = torch.Generator().manual_seed(1)
        for step in range(4):
            x = torch.randint(0, VOCAB, (4, 6), generator=gen)

            def fwd_bwd(x: torch.Tensor = x, step: int = step) -> None:
                loss = _loss(model, x)
                if step == 1:
                    raise RuntimeError("the user's step fails between forward and backward")
                loss.backward()

            try:
                h.step(fwd_bwd)
            except RuntimeError:
                # everything is where the user can read it: on the host masters, none in flight
                assert all(torch.isfinite(p).all() for p in model.parameters())
                continue
            opt.step()
            opt.zero_grad()
        out = {n: p.detach().clone() for n, p in model.named_parameters()}
        if mover is not None:  # nothing left on the device but what rests there (param's parameters)
            assert mover.transient == sum(mp.nbytes for mp in mover.params.values() if mp.placement == "param")
            mover.remove()
        backend.shutdown()
        return out

    plain = run(None)
    for where in ("full", "stream-full", "host-step", "param"):
        moved = run({"layers.0": where, "emb": where})
        assert all(torch.equal(moved[n], plain[n]) for n in plain), where


def test_remove_puts_the_state_back_and_training_goes_on_identically() -> None:
    torch.manual_seed(0)
    a, b = TiedLM(), TiedLM()
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    backend = CpuBackend()
    mover = StateMover(b, opt_b, backend, (), {"layers.0": "full", "layers.1": "stream", "emb": "host-step"})
    x = torch.randint(0, VOCAB, (4, 6))
    for model, opt, h in ((a, opt_a, Harness(None)), (b, opt_b, Harness(mover))):
        for _ in range(3):
            h.step(lambda model=model: _loss(model, x).backward())
            opt.step()
            opt.zero_grad()
    mover.remove()
    for model, opt in ((a, opt_a), (b, opt_b)):
        _loss(model, x).backward()
        opt.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n
    backend.shutdown()


class _NoHostStep(torch.optim.AdamW):
    """An optimizer whose step has no host kernel (as a CUDA-only fused one on CUDA)."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if any(p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
            raise RuntimeError("no CPU kernel for this step")
        return super().step(closure)


@pytest.mark.parametrize(("placement", "optimizer", "message"), [
    ({"layers.0": "full"}, _NoHostStep, "cannot step on the host"),
    ({"layers.9": "full"}, torch.optim.AdamW, "own no trainable parameter"),
    ({"layers.0": "somewhere"}, torch.optim.AdamW, "unknown placement"),
])
def test_bad_input_is_refused_before_anything_moves(placement: dict[str, str], optimizer: type, message: str) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = optimizer(model.parameters(), lr=1e-2)
    backend = CpuBackend()
    with pytest.raises(UserError, match=message):
        StateMover(model, opt, backend, (), placement)
    for n, p in model.named_parameters():  # nothing moved: every parameter is its own storage still
        assert torch.equal(p, before[n]) and p.grad is None
    backend.shutdown()


def test_a_parameter_outside_the_optimizer_cannot_be_placed() -> None:
    model = TiedLM()
    opt = torch.optim.AdamW(model.layers.parameters(), lr=1e-2)
    backend = CpuBackend()
    with pytest.raises(UserError, match="not in the optimizer"):
        StateMover(model, opt, backend, (), {"emb": "full"})
    backend.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("where", MOVING)
def test_cuda_moves_the_state_and_trains_as_the_plain_loop(where: str) -> None:
    # CUDA: pinned host masters, the copy streams; a group stepped on the device is bit-identical,
    # one stepped on the host runs the CPU kernel of the same optimizer (close, not bitwise)
    from swapsched.runtime.backends import CudaBackend

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")

    def run(placement: dict[str, str] | None) -> tuple[list[float], list[torch.Tensor], int]:
        torch.manual_seed(0)
        model = TiedLM().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        backend = CudaBackend()
        mover = StateMover(model, opt, backend, (), placement) if placement else None
        h = Harness(mover)
        gen = torch.Generator().manual_seed(1)
        losses, low = [], 0
        for _ in range(5):
            losses.append(h.train_step(model, torch.randint(0, VOCAB, (4, 6), generator=gen).cuda()))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            low = torch.cuda.memory_allocated()
        out = [p.detach().cpu() for p in model.parameters()]
        if mover is not None:
            mover.remove()
        return losses, out, low

    plain, moved = run(None), run(_placement(where))
    if where != "param":  # param's parameters rest on the device (R14); the others hold less there
        assert moved[2] < plain[2]
    if where in ("param", "stream", "stream-full"):
        assert moved[0] == plain[0] and all(torch.equal(a, b) for a, b in zip(moved[1], plain[1], strict=True))
    else:
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(moved[1], plain[1], strict=True))


@pytest.mark.parametrize(("first", "then"), [
    ({"emb": "full", "layers.0": "stream"}, {"emb": "host-step", "layers.2": "full"}),
    ({"layers.0": "host-step", "layers.1": "stream-full"}, {"layers.0": "param", "layers.1": "stream"}),
    ({"layers.1": "stream", "layers.2": "full"}, {}),
])
def test_a_change_of_placement_hands_the_host_over_and_trains_on_identically(first: dict[str, str], then: dict[str, str]) -> None:
    from swapsched.runtime.state_rest import to_device

    def run(switch: bool) -> dict[str, Any]:
        torch.manual_seed(0)
        model = TiedLM()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        backend = CpuBackend()
        mover: StateMover | None = StateMover(model, opt, backend, (), first) if switch else None
        gen = torch.Generator().manual_seed(1)
        for step in range(8):
            if switch and step == 4:
                assert mover is not None
                handover = mover.hand_over()
                # what rests on the host stays there: the host masters handed over are the ones the
                # new placement keeps (no device copy of a full group is made for the change)
                mover = StateMover(model, opt, backend, (), then, handover) if then else None
                kept = set(mover.params) if mover is not None else set()
                for pid, host in handover.host.items():
                    if mover is not None and pid in mover.params and mover.params[pid].placement in ("full", "stream-full"):
                        assert mover.params[pid].host is host
                to_device(opt, torch.device("cpu"), handover, keep=kept)
            x = torch.randint(0, VOCAB, (4, 6), generator=gen)
            Harness(mover).step(lambda x=x: _loss(model, x).backward())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        if mover is not None:
            mover.remove()
        backend.shutdown()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    plain, moved = run(False), run(True)
    for n, p in plain.items():
        assert torch.equal(p, moved[n]), n
