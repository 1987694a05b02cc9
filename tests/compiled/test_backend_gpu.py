"""compiled/ on CUDA: the asynchronous lowering (``ao.offload`` / ``ao.reload`` on torch's transfer
stream) holds the plan and trains as torch.compile does (R10). Run with ``-m gpu``."""

from __future__ import annotations

import copy

import pytest
import torch

from swapsched.compiled.backend import PlannedBackend
from swapsched.hardware import load_hardware
from tests.compiled.conftest import MLP
from tests.compiled.test_backend import Fixed, assert_holds_plan, min_plan

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_async_offload_trains_as_torch_compile(inner):
    torch.manual_seed(0)
    a = MLP(d=256).cuda()
    b = copy.deepcopy(a)
    be = PlannedBackend("100%", Fixed(min_plan), load_hardware("h100-pcie5"), inner=inner)
    torch._dynamo.reset()
    ca, cb = torch.compile(a, backend=be), torch.compile(b, backend=inner)
    for i in range(3):
        x = torch.randn(8, 128, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
        la, lb = ca(x), cb(x)
        la.backward()
        lb.backward()
        torch.cuda.synchronize()
        assert torch.equal(la, lb)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    (g,) = be.report().graphs
    assert g.offloaded > 0
    assert_holds_plan(g)
