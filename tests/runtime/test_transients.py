"""The transient meter (runtime/transients.py): R3's other bytes, by hand and against the meter
``swapsched run --compare`` reads, on a convnet whose backward holds buffers no hook sees."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from swapsched.deploy import SwapRuntime
from swapsched.device_meter import DeviceMeter
from swapsched.runtime.profiler import profile
from swapsched.runtime.transients import RUNTIME_ALLOCATING, TransientMeter

KB = 4000  # bytes of torch.ones(1000) in float32


def test_each_gap_holds_what_ops_made_and_not_the_saved_or_static_tensors() -> None:
    calls = [0]
    meter = TransientMeter(lambda: calls[0])
    with meter:
        a = torch.ones(1000)  # gap 0: +a
        b = a * 2  # gap 0: +b, saved below: the trace's
        w = a + 1  # gap 0: +w, a parameter's gradient by the end: static's
        calls[0] = 1
        meter.saved(b, 0)
        del a  # gap 1: -a
        c = b + 1  # gap 1: +c
        v = c.view(10, 100)  # a view: nothing new
        v.add_(1)  # in place: nothing new
        calls[0] = 2
        del c, v  # gap 2: -c
        d = torch.ones(2000)  # gap 2: +d (8000 bytes)
        del d
        calls[0] = 3  # gap 3: nothing happens
    per_call = meter.per_call(3, saved={0}, static=[w])
    meter.close()
    # gap 0: a alone (b saved, w static); gap 1: a until it dies, then c; gap 2: c carried in,
    # then d once c died; gap 3: nothing alive
    assert per_call == [KB, KB, 2 * KB, 0]


def test_a_saved_tensor_the_trace_does_not_keep_counts_as_transient() -> None:
    calls = [0]
    meter = TransientMeter(lambda: calls[0])
    with meter:
        a = torch.ones(1000)
        meter.saved(a, 5)  # packed, then dropped by the trace (never unpacked)
        calls[0] = 1
        del a
    assert meter.per_call(1, saved=set(), static=[]) == [KB, KB]
    assert meter.per_call(1, saved={5}, static=[]) == [0, 0]
    meter.close()


def test_paused_ops_and_host_buffers_are_not_the_steps() -> None:
    meter = TransientMeter(lambda: 0)
    with meter:
        meter.paused = True
        a = torch.ones(1000)
        meter.paused = False
        RUNTIME_ALLOCATING.on = True
        try:
            b = torch.empty(1000)
        finally:
            RUNTIME_ALLOCATING.on = False
        c = torch.ones(250)
    assert meter.per_call(0, saved=set(), static=[]) == [1000]
    del a, b, c
    meter.close()


def test_meta_tensors_are_measured_by_their_sizes() -> None:
    meter = TransientMeter(lambda: 0)
    with meter:
        a = torch.empty(1000, device="meta")
        b = a * 2
        del a, b
    assert meter.per_call(0, saved=set(), static=[]) == [2 * KB]
    meter.close()


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _conv_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = ConvNet()
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    for p in model.parameters():  # gradients live from the start: the meter counts them as static does
        p.grad = torch.zeros_like(p)
    return model, x, y


def test_a_convnets_trace_holds_what_the_meter_sees_in_a_plain_step() -> None:
    """Without the other bytes, this trace's peak is 30% under the meter's (convolution
    backward's gradients); with them it covers the meter, and by no more than the tail's share."""
    model, x, y = _conv_case()
    meter = DeviceMeter(model, None, "cpu")
    with meter.step():
        nn.functional.cross_entropy(model(x), y).backward()
    plain = meter.peak + x.untyped_storage().nbytes()  # the batch is made before the step: the trace counts it as static
    rt = SwapRuntime(budget="100%", policy="no-swap", backend="cpu", model=model)
    with rt:
        for _ in range(3):
            with rt.step():
                nn.functional.cross_entropy(model(x), y).backward()
        trace = rt.trace
    assert trace is not None
    saved_only = trace.static_bytes + int(trace.resident_bytes_no_swap.max())
    assert saved_only < 0.8 * plain  # what the runtime counted before
    assert plain <= trace.peak_bytes_no_swap <= 1.15 * plain


def test_the_offline_profiler_measures_the_same_other_bytes_on_cpu_and_meta() -> None:
    _, x, y = _conv_case()
    torch.manual_seed(0)
    cpu = profile(ConvNet(), (x,), lambda out: nn.functional.cross_entropy(out, y))
    meta_model = ConvNet().to("meta")
    meta = profile(meta_model, (x.to("meta"),), lambda out: nn.functional.cross_entropy(out, y.to("meta")))
    assert cpu.other_bytes.max() > 0
    assert list(cpu.other_bytes) == list(meta.other_bytes)


@pytest.mark.gpu
def test_on_cuda_the_trace_holds_what_the_caching_allocator_saw() -> None:
    """cuDNN's workspace is no op's output: the allocator's counters around each op add it."""
    torch.manual_seed(0)
    model = ConvNet().cuda()
    x, y = torch.randn(8, 3, 32, 32, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    nn.functional.cross_entropy(model(x), y).backward()
    torch.cuda.synchronize()
    plain = torch.cuda.max_memory_allocated()
    trace = profile(model, (x,), lambda out: nn.functional.cross_entropy(out, y))
    # the allocator also holds the labels and rounds each block up to 512 bytes
    assert trace.peak_bytes_no_swap >= 0.95 * plain
