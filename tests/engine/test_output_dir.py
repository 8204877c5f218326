"""engine/output_dir: <target>.partial, the manifest written last, the publish that never goes over what someone
else put in the target meanwhile."""

from __future__ import annotations

import os

import pytest

from slimckpt.engine import output_dir
from slimckpt.engine.output_dir import commit
from slimckpt.layout.merge_manifest import CommitError


def test_commit_refuses_a_target_filled_meanwhile(tmp_path):
    partial = output_dir.prepare_partial(str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "other").write_text("someone else's")
    with pytest.raises(CommitError, match="became non-empty"):
        commit(partial, str(tmp_path / "out"))
    assert (tmp_path / "out" / "other").exists() and os.path.isdir(partial)
