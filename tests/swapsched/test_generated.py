"""swapsched/generated.py: the random architectures the search's learned parts train on."""

from __future__ import annotations

import pytest

from swapsched.errors import UserError
from swapsched.generated import describe, random_architecture
from swapsched.runtime.profiler import profile


def _trace(seed: int):
    case = random_architecture(seed)
    return profile(case.model, case.inputs, case.loss_fn, device="meta", name=case.name)


def test_a_seed_is_one_architecture():
    a, b = _trace(5), _trace(5)
    assert describe(5) == describe(5)
    assert [(t.bytes, t.op, t.module) for t in a.tensors] == [(t.bytes, t.op, t.module) for t in b.tensors]
    assert describe(5) != describe(6)


@pytest.mark.parametrize("seed", range(12))
def test_every_block_is_a_recomputable_segment(seed):
    case = random_architecture(seed)
    n_blocks = len(case.model.blocks)
    trace = profile(case.model, case.inputs, case.loss_fn, device="meta", name=case.name)
    names = {sg.name for sg in trace.segments}
    assert {f"blocks.{i}" for i in range(n_blocks)} <= names  # R9: each element of ``blocks`` is a segment
    assert trace.n_tensors > 0 and trace.ideal_s > 0


def test_the_space_has_all_three_kinds_and_mixes_token_blocks():
    kinds = [describe(s).split()[0] for s in range(40)]
    assert {"tokens", "image", "vector"} <= set(kinds)
    assert any("+" in describe(s) for s in range(40))  # a model that interleaves two kinds of block


def test_a_negative_seed_is_a_clear_error():
    with pytest.raises(UserError, match="non-negative"):
        random_architecture(-1)
