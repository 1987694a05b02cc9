"""run_sharded.py: ``swapsched run MODEL --world-size N --compare`` on 2 gloo ranks."""

from __future__ import annotations

import pytest

from swapsched.cli import main
from swapsched.errors import UserError
from swapsched.run_sharded import run_sharded


@pytest.mark.timeout(300)
def test_every_method_trains_the_same_weights_and_the_rows_say_what_fits():
    # a rank's budget below FSDP2 without offload (the 5 units' whole state and activations)
    rows = {r.method: r for r in run_sharded("gpt", "1800000", 2, size="tiny", compare=True, rounds=1, round_steps=2)}
    assert list(rows) == ["default", "fsdp", "fsdp-offload", "fsdp-partial"]
    assert not rows["fsdp"].fits and rows["fsdp"].note.startswith("does not fit"), rows["fsdp"]
    for name in ("default", "fsdp-offload", "fsdp-partial"):
        r = rows[name]
        assert r.fits and r.bit_identical and r.units == 5 and r.peak_bytes <= r.budget_bytes == 1_800_000, r
    assert rows["fsdp-offload"].offloaded == 5 and 0 < rows["fsdp-partial"].offloaded < 5
    # default's peak by the runtime's accounting and by its audit meter, within the rank's budget
    d = rows["default"]
    assert d.runtime_peak_bytes is not None and d.audit_peak_bytes is not None
    assert max(d.runtime_peak_bytes, d.audit_peak_bytes) <= d.budget_bytes and d.ratio == 1.0


def test_one_rank_is_refused():
    with pytest.raises(UserError, match="at least 2 ranks"):
        run_sharded("gpt", "50%", 1, size="tiny")


def test_the_cli_refuses_what_a_sharded_run_does_not_take(capsys):
    assert main(["run", "gpt", "--size", "tiny", "--world-size", "2", "--policy", "min", "--no-progress"]) == 2
    assert "policy default" in capsys.readouterr().err
