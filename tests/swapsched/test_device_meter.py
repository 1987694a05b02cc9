"""device_meter.py: the peak of one step, whatever the method (hand-computed)."""

from __future__ import annotations

import torch

from swapsched.device_meter import DeviceMeter


def test_the_device_meter_counts_live_storages_at_their_peak():
    model = torch.nn.Linear(2, 2)  # 6 floats: 24 B of parameters, no gradients yet
    meter = DeviceMeter(model, None, "cpu")
    with meter.step():
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(500, dtype=torch.uint8)
        w = model.weight.t()  # a view of a storage made before the step: no new bytes
        v = b.view(5, 100)  # a view: the same storage, counted once
        del a  # 1,500 B were live at once; now 500
        c = torch.empty(200, dtype=torch.uint8)
        del c, v, w
    assert meter.peak == 24 + 1500
    del b


def test_the_device_meter_leaves_the_host_pools_buffers_out():
    from swapsched.runtime.host_pool import HostPool

    model = torch.nn.Linear(2, 2)
    meter = DeviceMeter(model, None, "cpu")
    pool = HostPool(pin=False)
    with meter.step():
        host = pool.take(4096)  # the emulated device's host memory, not the device's
        dev = torch.empty(100, dtype=torch.uint8)
    assert meter.peak == 24 + 100
    del host, dev
