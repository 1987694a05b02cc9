"""The host costs ``swapsched calibrate`` measures: the state mover's per-tensor cost (R13-R16)."""

from __future__ import annotations

import time
from typing import Any

from swapsched.runtime.calibrate import calibrate_state_hook


def test_the_state_movers_cost_per_tensor_is_recovered_beyond_its_copies(monkeypatch) -> None:
    # each gradient the mover takes costs it 1 ms more (a sleep in its post-accumulate hook), once
    # per parameter tensor per step: the calibration finds at least that per tensor, beyond the
    # copies it charges at copy_issue_s each; without the sleep, much less
    from swapsched.runtime.state_mover import StateMover

    base = calibrate_state_hook("cpu", 2e9, copy_issue_s=0.0, steps=6)
    grad_ready = StateMover._grad_ready

    def slow(self: StateMover, mp: Any) -> None:
        if self.in_step:
            time.sleep(1e-3)
        grad_ready(self, mp)

    monkeypatch.setattr(StateMover, "_grad_ready", slow)
    slowed = calibrate_state_hook("cpu", 2e9, copy_issue_s=0.0, steps=6)
    assert slowed >= 1e-3 and slowed - base >= 0.8e-3, (base, slowed)
    # the copies' cost comes off first: charged at more than the mover spends, nothing is left per tensor
    assert calibrate_state_hook("cpu", 2e9, copy_issue_s=1.0, steps=6) == 0.0
