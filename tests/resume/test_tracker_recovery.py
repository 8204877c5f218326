"""An empty latest_checkpointed_iteration.txt (verl's non-atomic write cut by a kill) resumes from
the newest complete step instead of crashing on int('') — through verl's own find_latest_ckpt_path
as the trainers call it, patched by slimckpt.resume.tracker_recovery."""

from __future__ import annotations

import json

import pytest

from slimckpt.layout.resume_manifest import FAILED_PREFIX, MANIFEST_NAME
from slimckpt.resume import tracker_recovery


def _verl_step(root, step, data=True, roles=("actor",)):
    d = root / f"global_step_{step}"
    for role in roles:
        (d / role).mkdir(parents=True)
        (d / role / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 2}))
    if data:
        (d / "data.pt").write_bytes(b"x")
    return d


@pytest.fixture
def find():
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    return tracker_recovery.wrap_find_latest_ckpt_path(find_latest_ckpt_path)


def test_verl_itself_crashes_on_an_empty_tracker(tmp_path):
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    _verl_step(tmp_path, 1)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("")
    with pytest.raises(ValueError):
        find_latest_ckpt_path(str(tmp_path))


def test_an_empty_tracker_resumes_from_the_newest_complete_step(tmp_path, find):
    _verl_step(tmp_path, 1)
    _verl_step(tmp_path, 2, roles=("actor", "critic"))
    _verl_step(tmp_path, 3, data=False)  # the trainer had not written data.pt: not finished
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("")
    assert find(str(tmp_path)) == str(tmp_path / "global_step_2")


def test_uncommitted_or_failed_slimckpt_steps_are_skipped(tmp_path, find):
    _verl_step(tmp_path, 1)
    s2 = _verl_step(tmp_path, 2)
    (s2 / "actor" / "dcp").mkdir()  # incremental format without its manifest
    s3 = _verl_step(tmp_path, 3)
    (s3 / "actor" / MANIFEST_NAME).write_text("{}")
    (s3 / "actor" / f"{FAILED_PREFIX}0.txt").write_text("disk full\n")  # written before the manifest
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("")
    assert find(str(tmp_path)) == str(tmp_path / "global_step_1")


def test_no_complete_step_is_a_clean_start_and_a_good_tracker_is_verls(tmp_path, find):
    _verl_step(tmp_path, 1, data=False)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("")
    assert find(str(tmp_path)) is None
    _verl_step(tmp_path, 4)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    assert find(str(tmp_path)) == str(tmp_path / "global_step_4")
