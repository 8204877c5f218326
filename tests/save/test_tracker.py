"""save/driver/tracker: the commit watcher moves verl's tracker only once every role's manifest is on disk, gives
up a step retention deleted, and watches the roles the configs save asynchronously."""

from __future__ import annotations

import pytest

import slimckpt.engine.resume_records as rr
import slimckpt.layout.resume_manifest as rm
from slimckpt.layout.resume_manifest import FAILED_PREFIX, TRACKER_NAME

from ..helpers.resume_dirs import commit_manifest as _commit
from ..helpers.resume_dirs import role_dir as _role_dir


def test_commit_watcher_moves_tracker_only_after_every_manifest(tmp_path):
    from slimckpt.save.driver.tracker import CommitWatcher

    root = str(tmp_path)
    actor = _role_dir(tmp_path, 4, "actor")
    critic = _role_dir(tmp_path, 4, "critic")
    watcher = CommitWatcher(root)
    watcher.after_save(4, ["actor", "critic"])
    _commit(actor, 4)
    (tmp_path / "global_step_4" / "data.pt").write_bytes(b"d")
    with pytest.raises(RuntimeError, match="not committed within"):
        # three of the watcher's 0.2 s polls: long enough to show it still waits, short enough to stay fast
        watcher.wait(timeout=0.6)  # the critic has no manifest yet
    assert rm.read_tracker(root) is None
    _commit(critic, 4)
    # the manifest is on disk: the watcher's next 0.2 s poll sees it; 10 s is a hang
    watcher.wait(timeout=10)
    assert rm.read_tracker(root) == 4


def test_commit_watcher_stops_on_a_failed_write(tmp_path):
    from slimckpt.save.driver.tracker import CommitWatcher

    actor = _role_dir(tmp_path, 2, "actor")
    watcher = CommitWatcher(str(tmp_path))
    watcher.after_save(2, ["actor"])
    rr.write_failure(str(actor), 1, "step 2: OSError: disk full")
    with pytest.raises(RuntimeError, match="failed"):
        # the failure marker is on disk: the watcher's next 0.2 s poll sees it; 10 s is a hang
        watcher.wait(timeout=10)
    assert rm.read_tracker(str(tmp_path)) is None


def test_commit_watcher_gives_up_a_step_retention_deleted(tmp_path):
    """Async at max_ckpt_to_keep=1: the next step's commit deleted this one before the watcher saw
    its manifest. The watcher neither hangs nor names it; the tracker stays where it was."""
    import shutil

    from slimckpt.save.driver.tracker import CommitWatcher

    _role_dir(tmp_path, 5, "actor")
    rr.write_tracker(str(tmp_path), 4)
    watcher = CommitWatcher(str(tmp_path))
    watcher.after_save(5, ["actor"])
    shutil.rmtree(tmp_path / "global_step_5")
    # the step dir is gone: the watcher's next 0.2 s poll gives it up; 10 s is a hang
    watcher.wait(timeout=10)
    assert rm.read_tracker(str(tmp_path)) == 4


@pytest.mark.parametrize("left", ["nothing", "manifest_removed"])
def test_commit_watcher_gives_up_a_step_whose_role_dir_retention_removed(tmp_path, left):
    """Retention removes the role dir (verl tracks role dirs) and leaves the step dir with
    data.pt; a delete cut short leaves the dir without its manifest. Once a newer step of that role
    is committed, the watcher gives the old step up without naming it, for any watched role."""
    import shutil

    from slimckpt.save.driver.tracker import CommitWatcher

    watcher = CommitWatcher(str(tmp_path))  # this run's saves: step 1, then 2
    for role in ("actor", "critic"):
        _role_dir(tmp_path, 1, role)
    (tmp_path / "global_step_1" / "data.pt").write_bytes(b"d")
    _commit(tmp_path / "global_step_1" / "actor", 1)
    for role in ("actor", "critic"):
        _commit(_role_dir(tmp_path, 2, role), 2)
    critic = tmp_path / "global_step_1" / "critic"
    if left == "nothing":
        shutil.rmtree(critic)
    watcher.after_save(1, ["actor", "critic"])
    # step 2 is committed: the watcher's next 0.2 s poll gives step 1 up; 10 s is a hang
    watcher.wait(timeout=10)
    assert rm.read_tracker(str(tmp_path)) is None
    assert "critic dir was deleted by retention once step 2 committed" in watcher.superseded


def test_commit_watcher_still_waits_for_an_unfinished_step_without_a_newer_commit(tmp_path):
    """A role dir without its manifest is given up only when a newer step of that role has
    committed: before that, it is a write still in flight (or a half-written step) and is never named."""
    from slimckpt.save.driver.tracker import CommitWatcher

    _role_dir(tmp_path, 3, "actor")
    (tmp_path / "global_step_3" / "data.pt").write_bytes(b"d")
    _role_dir(tmp_path, 4, "actor")  # the next step, not committed yet
    watcher = CommitWatcher(str(tmp_path))
    watcher.after_save(3, ["actor"])
    with pytest.raises(RuntimeError, match="not committed within"):
        # three of the watcher's 0.2 s polls: long enough to show it still waits, short enough to stay fast
        watcher.wait(timeout=0.6)
    assert watcher.superseded is None and rm.read_tracker(str(tmp_path)) is None
    _commit(tmp_path / "global_step_3" / "actor", 3)
    # the manifest is on disk: the watcher's next 0.2 s poll sees it; 10 s is a hang
    watcher.wait(timeout=10)
    assert rm.read_tracker(str(tmp_path)) == 3


def test_commit_watcher_names_a_step_below_a_newer_commit_left_from_before_the_run(tmp_path):
    """A resume that walked back from a damaged step 4 to step 2 saves step 3: step 4's old
    manifest is no commit of this run, so step 3 is named once it commits (not given up)."""
    from slimckpt.save.driver.tracker import CommitWatcher

    _commit(_role_dir(tmp_path, 4, "actor"), 4)
    rr.atomic_write_text(str(tmp_path / rm.TRACKER_NAME), "2")
    watcher = CommitWatcher(str(tmp_path))
    d = _role_dir(tmp_path, 3, "actor")
    (d.parent / "data.pt").write_bytes(b"d")
    watcher.after_save(3, ["actor"])
    with pytest.raises(RuntimeError, match="not committed within"):
        # three of the watcher's 0.2 s polls: long enough to show it still waits, short enough to stay fast
        watcher.wait(timeout=0.6)  # no manifest yet: still waiting, not superseded by step 4
    _commit(d, 3)
    # the manifest is on disk: the watcher's next 0.2 s poll sees it; 10 s is a hang
    watcher.wait(timeout=10)
    assert watcher.superseded is None and rm.read_tracker(str(tmp_path)) == 3


def test_watched_roles_follow_the_configs():
    from omegaconf import OmegaConf

    from slimckpt.save.driver.tracker import watched_roles

    def trainer(actor: dict, critic: dict, use_critic: bool = True):
        config = OmegaConf.create(
            {"actor_rollout_ref": {"actor": {"checkpoint": actor}}, "critic": {"checkpoint": critic}}
        )
        return type("T", (), {"config": config, "use_critic": use_critic})()

    slim = {"_target_": "slimckpt.verl.checkpoint_config.SlimCheckpointConfig", "incremental_save": True}
    verl = {"_target_": "verl.trainer.config.CheckpointConfig"}
    assert watched_roles(trainer({**slim, "async_save": False}, slim)) is None
    assert watched_roles(trainer({**slim, "async_save": True}, {**slim, "async_save": True})) == ["actor", "critic"]
    assert watched_roles(trainer({**slim, "async_save": True}, verl)) == ["actor"]
    assert watched_roles(trainer({**slim, "async_save": True}, slim, use_critic=False)) == ["actor"]
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.checkpoint.async_save=true"):
        watched_roles(trainer(verl, {**slim, "async_save": True}))


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


@pytest.mark.parametrize("retention_deletes", [False, True])
def test_commit_watcher_names_no_step_while_retention_holds_its_lock(tmp_path, retention_deletes):
    """Retention deletes under the exclusive lock of a role dir; the watcher checks and names a step under
    the shared one. While retention holds it the tracker does not move; after, the step is named, or given
    up when retention deleted it (a newer step of the role committed)."""
    import shutil

    from slimckpt.save.driver.tracker import CommitWatcher
    from slimckpt.storage import locks

    watcher = CommitWatcher(str(tmp_path))  # this run's saves: step 1, then 2
    actor = _role_dir(tmp_path, 1, "actor")
    _commit(actor, 1)
    (tmp_path / "global_step_1" / "data.pt").write_bytes(b"d")
    _commit(_role_dir(tmp_path, 2, "actor"), 2)
    held = locks.try_exclusive(str(actor), "deleting it (retention)")
    assert held is not None
    watcher.after_save(1, ["actor"])
    with pytest.raises(RuntimeError, match="not committed within"):
        # three of the watcher's 0.2 s polls: long enough to show it waits, short enough to stay fast
        watcher.wait(timeout=0.6)
    assert rm.read_tracker(str(tmp_path)) is None
    if retention_deletes:
        rr.remove_manifest(str(actor))
        shutil.rmtree(actor)
    held.release()
    # the lock is free: the watcher's next 0.2 s poll names or gives up the step; 10 s is a hang
    watcher.wait(timeout=10)
    if retention_deletes:
        assert rm.read_tracker(str(tmp_path)) is None and "deleted by retention" in watcher.superseded
    else:
        assert rm.read_tracker(str(tmp_path)) == 1 and watcher.superseded is None
