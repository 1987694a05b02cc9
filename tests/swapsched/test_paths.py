"""swapsched/_paths.py: files are written whole or not at all."""

from __future__ import annotations

import pytest

from swapsched._paths import atomic_path


def test_a_write_interrupted_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "plan.json"
    target.write_text("good")
    with pytest.raises(KeyboardInterrupt), atomic_path(target) as tmp:
        tmp.write_text("half of a new fi")
        raise KeyboardInterrupt
    assert target.read_text() == "good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_a_completed_write_replaces_the_file_and_keeps_the_suffix_for_format_sniffers(tmp_path):
    target = tmp_path / "sub" / "fig.png"
    with atomic_path(target) as tmp:
        assert tmp.suffix == ".png" and tmp.parent == target.parent and tmp != target
        tmp.write_bytes(b"png")
    assert target.read_bytes() == b"png"
    assert sorted(p.name for p in target.parent.iterdir()) == ["fig.png"]
