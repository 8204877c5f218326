"""Environment faults: a full disk, a read-only or unwritable directory, two writers on
one target give one clear line, fail or continue as configured, and leave nothing that looks committed."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import slimckpt.save.errors as save_errors
from slimckpt.layout.resume_manifest import FAILED_PREFIX, TRACKER_NAME, failure_markers
from slimckpt.save.target import SaveTarget, TargetState
from slimckpt.storage import locks
from slimckpt.verl.checkpoint_config import SlimCheckpointConfig
from tests.helpers.launch import REPO

from ..helpers.slim_logs import lines_of

# --------------------------------------------------------------------------- locks


def test_second_writer_fails_fast_naming_target_holder_and_fix(tmp_path):
    target = str(tmp_path / "out")
    with locks.writing(target, "merging a into it", fix="choose another --target_dir"):
        with pytest.raises(locks.LockBusy) as err:
            locks.acquire(target, exclusive=True, what="x", fix="choose another --target_dir")
    msg = str(err.value)
    assert "\n" not in msg and target in msg and f"pid {os.getpid()}" in msg and "merging a into it" in msg
    assert msg.endswith("choose another --target_dir")
    assert not os.path.exists(locks.lock_file_for(target))  # released: the file goes with it


def test_readers_share_and_exclude_writers(tmp_path):
    d = str(tmp_path / "step")
    with locks.reading(d, "merging it"), locks.reading(d, "loading it"):
        assert locks.try_exclusive(d, "deleting it") is None
        with pytest.raises(locks.LockBusy, match="loading it|merging it"):
            locks.acquire(d, exclusive=True, what="saving", fix="fix")
    lock = locks.try_exclusive(d, "deleting it")
    assert lock is not None
    with pytest.raises(locks.LockBusy, match="deleting it"):
        locks.acquire(d, exclusive=False, what="reading", fix="retry")
    lock.release()
    assert not os.path.exists(locks.lock_file_for(d))


def test_a_killed_holder_never_blocks(tmp_path):
    target = str(tmp_path / "out")
    code = (
        "import sys, time; from slimckpt.storage import locks\n"
        "l = locks.acquire(sys.argv[1], exclusive=True, what='writing', fix='')\n"
        # far longer than the checks below (milliseconds): the holder still holds its lock when killed
        "print('held', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, target], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(locks.LockBusy, match=f"pid {proc.pid}"):
            locks.acquire(target, exclusive=True, what="x", fix="y")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert os.path.exists(locks.lock_file_for(target))  # the killed holder left its file behind...
    with locks.writing(target, "x", fix="y"):  # ...which does not block
        pass


def test_lock_file_outside_the_directory(tmp_path):
    d = tmp_path / "global_step_3" / "actor"
    assert locks.lock_file_for(str(d)) == str(tmp_path / "global_step_3" / ".actor.slimckpt-lock")


# --------------------------------------------------------------------------- messages


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
    from slimckpt.merge.pipeline import _message
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


# --------------------------------------------------------------------------- merge


def test_two_merges_into_one_target(tmp_path):
    from slimckpt.merge.pipeline import merge
    from slimckpt.merge.plan import MergeError, MergeOptions
    from slimckpt_testing.synthetic import synthetic_checkpoint

    src = synthetic_checkpoint(tmp_path / "global_step_1" / "actor")
    target = str(tmp_path / "out")
    with locks.writing(target, "merging x into it", fix=""):
        with pytest.raises(MergeError) as err:
            merge(MergeOptions(local_dir=str(src), target_dir=target, progress=False))
    assert "merging x into it" in str(err.value) and "--target_dir" in str(err.value)
    assert not os.path.exists(target) and not os.path.exists(target + ".partial")


def test_merge_refuses_a_step_being_written(tmp_path):
    from slimckpt.merge.pipeline import merge
    from slimckpt.merge.plan import MergeError, MergeOptions
    from slimckpt_testing.synthetic import synthetic_checkpoint

    src = synthetic_checkpoint(tmp_path / "global_step_1" / "actor")
    with locks.writing(str(src), "saving step 1", fix=""):
        with pytest.raises(MergeError, match="saving step 1"):
            merge(MergeOptions(local_dir=str(src), target_dir=str(tmp_path / "out"), progress=False))


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_env_faults_script_through_verls_manager(tmp_path):
    """scripts/faults/env.py through verl's real FSDPCheckpointManager: the synchronous incremental
    save (stop) and quickstart with on_save_error=continue, under a file size limit and a held lock."""
    out = tmp_path / "faults.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.faults.env",
            "--json",
            str(out),
            "--paths",
            "incremental_sync,quickstart_continue",
            "--faults",
            "fsize_limit,lock,export_full",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        # 5 faulted saves through verl's manager (~60 s on a loaded host); 300 s is a hang
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(r["path"], r["fault"]): r for r in report["rows"]}
    assert len(rows) == 5 and ("quickstart_continue", "export_full") not in rows  # quickstart exports nothing
    full = rows.pop(("incremental_sync", "export_full"))
    if report["env"]["can_mount"]:  # the recipe as shipped exports: the disk fills inside the export
        assert full["verdict"] == "ok" and full["exit"] == "raised", full
        assert "huggingface" in full["message"] and "trainer.default_local_dir" in full["message"], full
        assert "--target_dir" not in full["message"], full
    for r in rows.values():
        assert r["failed"] and not r["looks_committed"] and not r["tracker_moved"], r
        assert r["one_line"] and r["names_path"], r
    assert rows[("incremental_sync", "fsize_limit")]["exit"] == "raised"
    assert "File too large" in rows[("incremental_sync", "fsize_limit")]["message"]
    assert rows[("quickstart_continue", "fsize_limit")]["exit"] == "continued"  # training goes on
    assert rows[("quickstart_continue", "lock")]["exit"] == "raised"  # a lock conflict always stops


@pytest.mark.parametrize("keep_going", [False, True])
def test_async_commit_watcher_follows_on_save_error(tmp_path, keep_going):
    """Async saves: the driver's watcher sees the failed step's marker; continue logs it, stop raises;
    the tracker never moves to it either way."""
    from slimckpt.save.driver.tracker import CommitWatcher

    role = tmp_path / "global_step_5" / "actor"
    role.mkdir(parents=True)
    (tmp_path / TRACKER_NAME).write_text("4")
    (role / f"{FAILED_PREFIX}0.txt").write_text("disk full")
    watcher = CommitWatcher(str(tmp_path))
    watcher.keep_going = keep_going
    watcher.after_save(5, ["actor"])
    if keep_going:
        # the failure marker is on disk: the watcher's next 0.2 s poll sees it; 30 s is a hang
        watcher.wait(timeout=30)
    else:
        with pytest.raises(RuntimeError, match="step 5 failed"):
            watcher.wait(timeout=30)
    assert (tmp_path / TRACKER_NAME).read_text() == "4"
