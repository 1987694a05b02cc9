"""run.py: a run under the runtime, and the interleaved comparison."""

from __future__ import annotations


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
