"""run.py: the device meter of ``run --compare`` (hand-computed) and the interleaved comparison."""

from __future__ import annotations

import torch

from swapsched.run import DeviceMeter


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
    from swapsched.runtime.backends import HostPool

    model = torch.nn.Linear(2, 2)
    meter = DeviceMeter(model, None, "cpu")
    pool = HostPool(pin=False)
    with meter.step():
        host = pool.take(4096)  # the emulated device's host memory, not the device's
        dev = torch.empty(100, dtype=torch.uint8)
    assert meter.peak == 24 + 100
    del host, dev


def test_run_with_adamw_under_a_byte_budget_below_the_static_bytes_moves_the_state():
    from swapsched.run import run_runtime
    from swapsched.runtime.profiler import profile
    from swapsched.zoo import build_model

    case = build_model("gpt", "tiny", seed=0)
    trace = profile(case.model, case.inputs, case.loss_fn, state="adamw")
    budget = trace.static_bytes // 2 + 2 * (trace.min_feasible_bytes - trace.static_bytes)  # as test_swapper_state
    assert budget < trace.min_feasible_bytes  # no plan of the activations alone meets it
    res = run_runtime("gpt", "default", str(budget), 7, size="tiny", backend="cpu", optimizer="adamw")
    assert res.loss_matches and res.plan_followed
    assert res.peak_device_bytes <= budget


def test_compare_times_a_moving_state_without_the_audit_meter_and_meters_it_once(monkeypatch):
    # the audit meter's dispatch mode slows every op: a runtime row is timed without it and
    # audited only in its metered step (it was on in the timed rounds, putting default at 4.5x
    # plain where it ran at 1.9x)
    from swapsched import run as run_mod

    seen: list[tuple[str, bool, bool]] = []
    step = run_mod._Method.step

    def spy(self, meter=None):
        if self.runtime is not None:
            seen.append((self.name, meter is not None, self.runtime.audit))
        return step(self, meter)

    monkeypatch.setattr(run_mod._Method, "step", spy)
    # a peer named among the policies too is one row, the peer's (was: two rows, two notes)
    cmp = run_mod.compare_live("gpt", "2000000", ["default", "zero-offload"], size="tiny", backend="cpu", rounds=2,
                               round_steps=1, optimizer="adamw")
    names = [r.method for r in cmp.rows]
    assert len(names) == len(set(names)) and "zero-offload" in names
    assert seen and all(audit == metered for _, metered, audit in seen)
    assert {name for name, metered, _ in seen if metered} == {r.method for r in cmp.rows} - {"plain", "checkpoint",
                                                                                          "selective-checkpoint"}
    default = next(r for r in cmp.rows if r.method == "default")
    assert "audit meter" in default.note and default.fits and default.loss_matches
