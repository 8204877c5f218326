"""save/errors: a save that fails (a full disk, a read-only or unwritable directory, a lost rank, another writer)
gives one line with the trainer's fix, fails or continues as on_save_error says, and leaves nothing that
looks committed."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import slimckpt.save.errors as save_errors
from slimckpt.layout.resume_manifest import FAILED_PREFIX, TRACKER_NAME, failure_markers
from slimckpt.save.target import SaveTarget, TargetState
from slimckpt.storage import locks
from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

from ..helpers.slim_logs import lines_of


def test_describe_disk_full_and_read_only():
    path = "/ckpt/global_step_3/actor"
    full = save_errors.describe_save_error(OSError(errno.ENOSPC, "No space left on device", path + "/x.pt"), path, 3)
    assert "step 3" in full and path + "/x.pt" in full and "free space" in full and "\n" not in full
    ro = save_errors.describe_save_error(PermissionError(errno.EROFS, "Read-only file system", path), path, 3)
    assert "not writable" in ro and "default_local_dir" in ro


@pytest.mark.parametrize("code,fix", [(errno.ENOSPC, "larger filesystem"), (errno.EROFS, "writable directory")])
def test_an_export_that_fails_in_training_gives_the_trainers_fix(code, fix):
    """The export's writers describe an OS error for `slimckpt merge` (--target_dir); inside a save
    (here as the background write's failure reaches the next save) the line is the trainer's."""
    from slimckpt.engine.out_files import os_error
    from slimckpt.merge.steps import message as _message
    from slimckpt.storage.os_errors import MERGE_FIXES

    step_dir = "/ckpt/global_step_3/critic"
    export = os_error(
        OSError(code, os.strerror(code), step_dir + "/huggingface/model.safetensors"),
        step_dir + "/huggingface/model.safetensors",
        4096,
    )
    assert "--target_dir" in str(export) and "--target_dir" in _message(export, MERGE_FIXES)  # the merge's words
    try:
        try:
            raise export
        except Exception as exc:
            raise RuntimeError(f"slimckpt: the background write of step 3 to {step_dir} failed: {exc}") from exc
    except RuntimeError as wrapped:
        line = save_errors.describe_save_error(wrapped, step_dir.replace("_3", "_4"), 4)
    assert "--target_dir" not in line and "\n" not in line, line
    assert step_dir + "/huggingface/model.safetensors" in line and fix in line, line
    assert "trainer.default_local_dir" in line and "on_save_error=continue" in line, line
    if code == errno.ENOSPC:
        assert "trainer.max_critic_ckpt_to_keep" in line, line  # the role whose dir is full
    merge_line = _message(export, save_errors.trainer_fixes(step_dir))  # the in-training export's merge (hf_export)
    assert "--target_dir" not in merge_line and "trainer.default_local_dir" in merge_line


def test_describe_digs_through_dcp_and_torch_wrappers():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise OSError(errno.EFBIG, "File too large", "/c/dcp/__0_0.distcp")
    except OSError as exc:
        wrapped = CheckpointException("CheckpointException ranks:dict_keys([0])", {0: _wrap_exception(exc)})
    msg = save_errors.describe_save_error(wrapped, "/c", 5)
    assert "/c/dcp/__0_0.distcp" in msg and "File too large" in msg
    short = save_errors.describe_save_error(RuntimeError("[enforce fail] . unexpected pos 61440 vs 61328"), "/tmp", 5)
    assert "ulimit -f" in short


def test_on_save_error_is_checked():
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    assert SlimCheckpointConfig().on_save_error == "stop"
    with pytest.raises(ValueError, match="did you mean 'continue'"):
        SlimCheckpointConfig(on_save_error="contnue")
    with pytest.raises(TypeError, match="on_save_error"):
        SlimCheckpointConfig(on_save_eror="stop")


# --------------------------------------------------------------------------- guarded_save

GLOO_TIMEOUT = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 5000ms for "
    "send operation to complete"
)


def _manager(policy: str):
    return SaveTarget(None, None, SlimCheckpointConfig(on_save_error=policy), TargetState(), rank=0)


def _failing_save(role: Path):
    def save():
        role.mkdir(parents=True, exist_ok=True)
        (role / "model_world_size_1_rank_0.pt").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", str(role / "model_world_size_1_rank_0.pt"))

    return save


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_failed_save_is_marked_and_discarded(tmp_path, policy):
    role = tmp_path / "global_step_2" / "actor"
    manager = _manager(policy)
    if policy == "stop":
        with pytest.raises(save_errors.SaveFailed, match="No space left"):
            save_errors.guarded_save(manager, str(role), 2, _failing_save(role))
    else:
        with lines_of(save_errors.log) as logged:
            assert save_errors.guarded_save(manager, str(role), 2, _failing_save(role)) is None
        assert "CHECKPOINT NOT SAVED" in logged.getvalue()
    assert failure_markers(str(role)) and not (role / "model_world_size_1_rank_0.pt").exists()
    assert manager.state.save_failed and not os.path.exists(locks.lock_file_for(str(role)))


def test_a_failure_after_the_manifest_leaves_the_step_committed(tmp_path):
    """A peer lost while the ranks learn the commit's outcome (rank 0 already wrote the manifest,
    and the tracker's watcher may already name the step): the save still fails, on every policy,
    but neither the failure note nor the discard touches the committed dir."""
    import slimckpt.engine.resume_records as rr
    import slimckpt.layout.resume_manifest as rm

    role = tmp_path / "global_step_5" / "critic"
    shard = role / "extra_state_world_size_2_rank_0.pt"

    def save():
        role.mkdir(parents=True)
        shard.write_bytes(b"rows" * 64)
        rr.write_manifest(
            str(role),
            rm.Manifest(
                global_step=5, world_size=2, contents=["extra"], files=rm.describe_files(str(role), [shard.name])
            ),
        )
        raise RuntimeError(GLOO_TIMEOUT)

    with pytest.raises(save_errors.SaveFailed):
        save_errors.guarded_save(_manager("continue"), str(role), 5, save)
    assert not failure_markers(str(role)) and shard.exists()
    assert rm.check_committed(str(role)).global_step == 5
    assert not rr.write_failure(str(role), 1, "peer lost") and not failure_markers(str(role))


def test_a_save_after_a_lost_rank_fails_at_once(tmp_path, monkeypatch):
    """The actor's background write lost a rank; the critic's first save of the same step would
    make its group with the lost rank (a rendezvous that waits for the store's timeout). It fails
    at once instead, on every policy, naming the rank, before any collective."""
    from slimckpt.dist import heartbeat, lost_rank

    monkeypatch.setattr(heartbeat, "LOST", heartbeat.LostRanks())
    monkeypatch.setattr(lost_rank, "in_a_job", lambda: True)
    actor, critic = tmp_path / "global_step_1" / "actor", tmp_path / "global_step_1" / "critic"
    first = lost_rank.peer_loss_line(RuntimeError(GLOO_TIMEOUT), str(actor), 1)
    assert first is not None
    monkeypatch.setattr(save_errors, "take_writer_lock", lambda *a: pytest.fail("a collective with the lost rank"))
    with pytest.raises(save_errors.SaveFailed) as info:
        save_errors.guarded_save(_manager("continue"), str(critic), 1, lambda: pytest.fail("saved anyway"))
    line = str(info.value)
    assert str(critic) in line and "found by an earlier save of this job" in line and "restart the job" in line
    assert failure_markers(str(critic))  # the tracker's watcher stops waiting for the step


def test_a_lock_conflict_stops_even_with_continue(tmp_path):
    role = tmp_path / "global_step_2" / "actor"
    role.mkdir(parents=True)
    with locks.writing(str(role), "saving step 2 (other run)", fix=""):
        with pytest.raises(save_errors.SaveFailed, match="other run"):
            save_errors.guarded_save(_manager("continue"), str(role), 2, lambda: pytest.fail("saved anyway"))
    assert not failure_markers(str(role))  # the other run's dir is not ours to mark


def test_restore_tracker_after_a_failed_step(tmp_path):
    role = tmp_path / "global_step_4" / "actor"
    role.mkdir(parents=True)
    (tmp_path / TRACKER_NAME).write_text("4")
    assert not save_errors.restore_tracker(str(tmp_path), 4, 3)  # no marker: the step is good
    (role / f"{FAILED_PREFIX}0.txt").write_text("disk full")
    assert save_errors.restore_tracker(str(tmp_path), 4, 3)
    assert (tmp_path / TRACKER_NAME).read_text() == "3"
    (tmp_path / TRACKER_NAME).write_text("4")
    assert save_errors.restore_tracker(str(tmp_path), 4, None) and not (tmp_path / TRACKER_NAME).exists()
