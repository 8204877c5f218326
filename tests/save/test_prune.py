"""Retention never deletes the last committed step, nor one being read or written,
and verl 0.9.1's own retention, for comparison, does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import slimckpt.save.retention.prune as retention
import slimckpt.verl.checkpoint_patches as verl_retention
from slimckpt.layout.resume_manifest import MANIFEST_NAME, TRACKER_NAME
from slimckpt.storage import locks

from ..helpers.slim_logs import lines_of


class FakeManager:
    """The retention state of verl's BaseCheckpointManager (rank 0): its list of saved role dirs."""

    rank = 0

    def __init__(self) -> None:
        self.previous_saved_paths: list[str] = []

    def remove_previous_save_local_path(self, path):
        from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

        BaseCheckpointManager.remove_previous_save_local_path(self, path)


def _step(root: Path, n: int, manifest: bool = False) -> str:
    role = root / f"global_step_{n}" / "actor"
    role.mkdir(parents=True)
    (role / "model_world_size_1_rank_0.pt").write_bytes(b"x" * 10)
    if manifest:
        (role / MANIFEST_NAME).write_text("{}")
    return str(role)


def _tracker(root: Path, n: int) -> None:
    (root / TRACKER_NAME).write_text(str(n))


def _verl(name: str):
    """verl's own method, unpatched (the registry may have patched the class in this process)."""
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    fn = getattr(BaseCheckpointManager, name)
    return getattr(fn, "__wrapped__", fn)


# --------------------------------------------------------------------------- verl's behaviour


def test_verl_deletes_the_trackers_step_before_the_new_save(tmp_path):
    """max_keep=2, step 2 saved on the actor but its critic failed (tracker still at 1): verl's
    ensure_checkpoint_capacity at the start of step 3's save deletes step 1, the only committed one."""
    m = FakeManager()
    s1, s2 = _step(tmp_path, 1), _step(tmp_path, 2)
    m.previous_saved_paths = [s1, s2]
    _tracker(tmp_path, 1)
    _verl("ensure_checkpoint_capacity")(m, 2)
    assert not os.path.exists(s1)  # the tracker now names a deleted step


def test_verl_register_deletes_the_trackers_step_with_keep_1(tmp_path):
    m = FakeManager()
    s1 = _step(tmp_path, 1)
    m.previous_saved_paths = [s1]
    _tracker(tmp_path, 1)
    s2 = _step(tmp_path, 2)
    _verl("register_checkpoint")(m, s2, 1)  # inside the actor's save, before the trainer writes the tracker
    assert not os.path.exists(s1)


def test_verl_deletes_a_step_being_read(tmp_path):
    m = FakeManager()
    s1 = _step(tmp_path, 1)
    _tracker(tmp_path, 2)
    m.previous_saved_paths = [s1]
    with locks.reading(s1, "merging it"):
        _verl("register_checkpoint")(m, _step(tmp_path, 2), 1)
        assert not os.path.exists(s1)


# --------------------------------------------------------------------------- slimckpt's policy


def test_nothing_is_deleted_before_a_save(tmp_path):
    m = FakeManager()
    m.previous_saved_paths = [_step(tmp_path, n) for n in (1, 2, 3)]
    verl_retention.before_save(m, 2)
    assert all(os.path.exists(p) for p in m.previous_saved_paths) and len(m.previous_saved_paths) == 3


def test_keep_1_keeps_the_trackers_step_until_the_tracker_moves(tmp_path):
    m = FakeManager()
    s1 = _step(tmp_path, 1)
    verl_retention.after_save(m, s1, 1)
    _tracker(tmp_path, 1)
    s2 = _step(tmp_path, 2)
    assert verl_retention.after_save(m, s2, 1) == []  # the tracker still names step 1
    assert os.path.exists(s1) and m.previous_saved_paths == [s1, s2]
    _tracker(tmp_path, 2)
    s3 = _step(tmp_path, 3)
    assert verl_retention.after_save(m, s3, 1) == [s1]  # step 2 is the tracker's now
    assert not os.path.exists(s1) and os.path.exists(s2) and m.previous_saved_paths == [s2, s3]


def test_keep_2_failed_critic_keeps_the_committed_step(tmp_path):
    m = FakeManager()
    s1, s2 = _step(tmp_path, 1), _step(tmp_path, 2)
    m.previous_saved_paths = [s1, s2]
    _tracker(tmp_path, 1)
    verl_retention.before_save(m, 2)
    s3 = _step(tmp_path, 3)
    verl_retention.after_save(m, s3, 2)
    assert os.path.exists(s1)  # verl deleted it (test above); here the tracker protects it


def test_keep_none_or_zero_keeps_everything(tmp_path):
    for keep in (None, 0, -1):
        m = FakeManager()
        for n in range(1, 4):
            verl_retention.after_save(m, str(tmp_path / f"k{keep}" / f"global_step_{n}" / "actor"), keep)
        assert len(m.previous_saved_paths) == 3


def test_a_locked_step_is_skipped_then_deleted_at_the_next_save(tmp_path):
    m = FakeManager()
    s1 = _step(tmp_path, 1)
    verl_retention.after_save(m, s1, 1)
    _tracker(tmp_path, 2)
    with locks.reading(s1, "merging it"), lines_of(retention.log) as logged:
        assert verl_retention.after_save(m, _step(tmp_path, 2), 1) == []
    assert os.path.exists(s1) and "holds its lock" in logged.getvalue()
    _tracker(tmp_path, 3)
    assert verl_retention.after_save(m, _step(tmp_path, 3), 1) == [s1, str(tmp_path / "global_step_2" / "actor")]
    assert not os.path.exists(s1)


def test_a_step_locked_by_another_process_is_kept(tmp_path):
    m = FakeManager()
    s1 = _step(tmp_path, 1)
    verl_retention.after_save(m, s1, 1)
    code = (
        "import sys, time; from slimckpt.storage import locks\n"
        # far longer than the checks below (milliseconds): the reader still holds its lock when killed
        "with locks.reading(sys.argv[1], 'reading it'):\n print('held', flush=True); time.sleep(30)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, s1], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert verl_retention.after_save(m, _step(tmp_path, 2), 1) == []
        assert os.path.exists(s1)
    finally:
        proc.kill()
        proc.wait()
    # the kernel dropped the killed reader's lock: nothing stale blocks
    assert verl_retention.after_save(m, _step(tmp_path, 3), 1) == [s1, str(tmp_path / "global_step_2" / "actor")]


def test_an_incremental_step_loses_its_manifest_first(tmp_path, monkeypatch):
    s1 = _step(tmp_path, 1, manifest=True)
    import shutil

    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # a delete cut short
    assert retention.delete_step_dir(s1) is None
    assert not os.path.exists(os.path.join(s1, MANIFEST_NAME))


def test_the_verl_patch_routes_through_the_policy(tmp_path):
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    from slimckpt.verl.features import switch_on

    switch_on("checkpoint")
    m = FakeManager()
    s1, s2 = _step(tmp_path, 1), _step(tmp_path, 2)
    m.previous_saved_paths = [s1, s2]
    _tracker(tmp_path, 1)
    BaseCheckpointManager.ensure_checkpoint_capacity(m, 2)
    assert os.path.exists(s1) and os.path.exists(s2)
    BaseCheckpointManager.register_checkpoint(m, _step(tmp_path, 3), 1)
    assert os.path.exists(s1) and not os.path.exists(s2)  # s1: the tracker's; s2: older than the newest, unprotected


def test_resume_state_retention_uses_the_policy(tmp_path):
    from slimckpt.options.checkpoint_options import CheckpointOptions
    from slimckpt.save.step_commit import make_room, register_committed
    from slimckpt.save.target import SaveTarget, TargetState

    manager = FakeManager()
    m = SaveTarget(None, None, CheckpointOptions(), TargetState(), saved_paths=manager.previous_saved_paths)
    s1 = _step(tmp_path, 1, manifest=True)
    register_committed(m, s1, 1)
    _tracker(tmp_path, 1)
    make_room(m, 1)
    s2 = _step(tmp_path, 2, manifest=True)
    register_committed(m, s2, 1)
    assert os.path.exists(s1)
    _tracker(tmp_path, 2)
    register_committed(m, _step(tmp_path, 3, manifest=True), 1)
    assert not os.path.exists(s1)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_random_sequences_never_lose_the_trackers_step(tmp_path, keep):
    """Saves that succeed or fail at random, the tracker moving only on success: after every save
    the tracker's step is on disk and at most keep+1 steps are."""
    import random

    rng = random.Random(keep)
    m = FakeManager()
    tracker = None
    for n in range(1, 40):
        path = _step(tmp_path, n)
        if rng.random() < 0.3:  # the save failed: verl never registers it
            continue
        verl_retention.after_save(m, path, keep)
        if rng.random() < 0.8:  # the trainer wrote the tracker (else e.g. the critic failed)
            tracker = n
            _tracker(tmp_path, n)
        if tracker is not None:
            assert os.path.isdir(tmp_path / f"global_step_{tracker}" / "actor")
        assert len(m.previous_saved_paths) <= keep + 1


def test_a_load_holds_a_read_lock(tmp_path):
    """verl's (wrapped) load_checkpoint reads under a shared lock: retention skips the dir meanwhile."""
    from slimckpt.verl.checkpoint_patches import wrap_load_checkpoint

    s1 = _step(tmp_path, 1)
    seen = []

    def original(self, local_path, hdfs_path=None, del_local_after_load=False):
        seen.append(locks.try_exclusive(local_path, "deleting it (retention)"))

    import torch.distributed as dist

    # the wrapped load checks the rank files' pickles with every rank of the job: a job of one here
    manager = FakeManager()
    manager.checkpoint_config, manager.world_size = SimpleNamespace(trust_pickle=False), 1
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        wrap_load_checkpoint(original)(manager, s1)
    finally:
        dist.destroy_process_group()
    assert seen == [None]
    assert locks.try_exclusive(s1, "deleting it") is not None  # released after the load


# --------------------------------------------------------------------------- an earlier launch's steps (retention/earlier_steps)


def _incremental_after_save(saved: list[str], new_path: str, keep: int, state=None):
    from slimckpt.options.checkpoint_options import CheckpointOptions
    from slimckpt.save.target import TargetState

    state = state or TargetState()
    options = CheckpointOptions(incremental_save=True, keep_optimizer_last=None)
    return state, retention.after_save(state, options, saved, new_path, keep)


def test_an_earlier_launchs_committed_steps_are_pruned_at_the_first_commit(tmp_path, caplog):
    """A job restarted from step 4 saves step 5: the steps its earlier launches committed (2, 3) go by the
    same rules as its own; verl's step 1 from before slimckpt, a save that never committed (6: no manifest)
    and a step numbered above the new one (7, an earlier launch that went further) stay and are named."""
    verl_step = _step(tmp_path, 1)  # verl's own files, no manifest
    for n in (2, 3, 4, 7):
        _step(tmp_path, n, manifest=True)
    uncommitted = _step(tmp_path, 6)
    _tracker(tmp_path, 4)
    new = _step(tmp_path, 5, manifest=True)
    saved: list[str] = []
    with caplog.at_level("INFO", logger="slimckpt"):
        state, deleted = _incremental_after_save(saved, new, keep=2)
    assert sorted(os.path.basename(os.path.dirname(p)) for p in deleted) == ["global_step_2", "global_step_3"]
    left = sorted(p.parent.name for p in tmp_path.glob("global_step_*/actor"))  # role dirs go, as verl's do
    assert left == ["global_step_1", "global_step_4", "global_step_5", "global_step_6", "global_step_7"]
    assert os.path.isdir(verl_step) and os.path.isdir(uncommitted)
    assert [os.path.basename(os.path.dirname(p)) for p in saved] == ["global_step_4", "global_step_5"]
    text = caplog.text
    assert f"retention keeps {verl_step}: it holds no slimckpt manifest" in text
    assert f"retention keeps {tmp_path}/global_step_7/actor: an earlier launch saved it after" in text
    # looked at once per target: the next commit deletes step 4 (the tracker moved on) and nothing else
    _tracker(tmp_path, 5)
    _, deleted = _incremental_after_save(saved, _step(tmp_path, 8, manifest=True), keep=2, state=state)
    assert [os.path.basename(os.path.dirname(p)) for p in deleted] == ["global_step_4"]
    assert (tmp_path / "global_step_1" / "actor").is_dir() and (tmp_path / "global_step_7" / "actor").is_dir()


def test_the_step_the_tracker_names_survives_an_earlier_launchs_pruning(tmp_path):
    """A relaunch resumed from step 2 (the tracker names it) with keep 1: step 2 stays until the tracker moves."""
    for n in (1, 2):
        _step(tmp_path, n, manifest=True)
    _tracker(tmp_path, 2)
    saved: list[str] = []
    _, deleted = _incremental_after_save(saved, _step(tmp_path, 3, manifest=True), keep=1)
    assert [os.path.basename(os.path.dirname(p)) for p in deleted] == ["global_step_1"]
    assert (tmp_path / "global_step_2" / "actor").is_dir()


def test_model_only_tiers_leave_earlier_steps_to_verls_list(tmp_path):
    """quickstart/intermediate write verl's format without a resume manifest: nothing is adopted or named."""
    from slimckpt.options.checkpoint_options import CheckpointOptions
    from slimckpt.save.target import TargetState

    for n in (1, 2, 3):
        _step(tmp_path, n)
    saved: list[str] = []
    deleted = retention.after_save(TargetState(), CheckpointOptions(), saved, _step(tmp_path, 4), 1)
    assert deleted == [] and len(list(tmp_path.glob("global_step_*/actor"))) == 4


def test_a_roles_commit_leaves_the_step_before_its_optimizer_whatever_the_tracker_says(tmp_path, monkeypatch):
    """keep_optimizer_last=1, an async tracker still on step 1 when step 3's actor commits: step 2 keeps its
    optimizer (step 3's critic may still fail, and the run then resumes step 2); step 1, not the tracker's
    after all once the tracker moves, loses it at the next save's start."""
    from slimckpt.options.checkpoint_options import CheckpointOptions
    from slimckpt.save.target import TargetState

    dropped: list[str] = []
    monkeypatch.setattr(retention, "drop_step_optimizer", lambda path, keep: dropped.append(path))
    options = CheckpointOptions(incremental_save=True, keep_optimizer_last=1)
    s1, s2, s3 = (_step(tmp_path, n, manifest=True) for n in (1, 2, 3))
    _tracker(tmp_path, 1)  # the watcher has not named step 2 yet
    saved = [s1, s2]
    retention.after_save(TargetState(), options, saved, s3, 3)
    assert s2 not in dropped and s1 not in dropped  # step 1: the tracker's; step 2: the step before
    _tracker(tmp_path, 3)
    assert set(retention.optimizer_drops(options, saved, 3)) == {s1, s2}  # the next save's start


# --------------------------------------------------------------------------- the peak `slimckpt plan` states


class _Manager:
    """verl's BaseCheckpointManager retention state: its list of saved role dirs."""

    def __init__(self) -> None:
        self.previous_saved_paths: list[str] = []

    def remove_previous_save_local_path(self, path):
        from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

        BaseCheckpointManager.remove_previous_save_local_path(self, path)


def _verl_method(name: str):
    """verl's own method, unpatched (the registry may have patched the class in this process)."""
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    fn = getattr(BaseCheckpointManager, name)
    return getattr(fn, "__wrapped__", fn)


def _simulate_peak(root, keep, order, saves=6, tracker_stuck_at=()):
    """Role dirs on disk at the peak over `saves` saves, in the trainer's order: the actor's save
    (retention inside it), then the tracker. `tracker_stuck_at`: steps whose tracker write is skipped
    (a failed critic with on_save_error=continue)."""
    import slimckpt.verl.checkpoint_patches as verl_retention
    from slimckpt.layout.resume_manifest import TRACKER_NAME

    m, peak = _Manager(), 0
    for step in range(1, saves + 1):
        if order == "verl":
            _verl_method("ensure_checkpoint_capacity")(m, keep)
        else:
            verl_retention.before_save(m, keep)
        role = root / f"global_step_{step}" / "actor"
        role.mkdir(parents=True)
        (role / "model_world_size_1_rank_0.pt").write_bytes(b"x")
        peak = max(peak, len(list(root.glob("global_step_*/actor"))))
        if order == "verl":
            _verl_method("register_checkpoint")(m, str(role), keep)
        else:
            verl_retention.after_save(m, str(role), keep)
        if step not in tracker_stuck_at:
            (root / TRACKER_NAME).write_text(str(step))
    return peak


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_peak_steps_match_what_retention_leaves_on_disk(tmp_path, keep):
    import slimckpt.save.retention.prune as retention

    (tmp_path / "v").mkdir(), (tmp_path / "s").mkdir()
    verl_peak = _simulate_peak(tmp_path / "v", keep, "verl")
    slim_peak = _simulate_peak(tmp_path / "s", keep, "slimckpt")
    assert verl_peak == retention.verl_peak_steps(keep) == max(keep, 2)
    assert slim_peak == retention.peak_steps(keep)[0] == verl_peak + 1  # the safe order costs one step


def test_peak_steps_with_the_tracker_behind(tmp_path):
    import slimckpt.save.retention.prune as retention

    assert _simulate_peak(tmp_path, 2, "slimckpt", tracker_stuck_at={3}) == retention.peak_steps(2)[1] == 4
    assert retention.peak_steps(1) == (3, 3)
    assert retention.peak_steps(None) is None and retention.verl_peak_steps(None) is None
    assert retention.peak_steps(0) is None  # verl: 0 and below keep everything


def test_a_step_the_tracker_names_after_the_decision_is_kept(tmp_path, monkeypatch):
    """Async at max_ckpt_to_keep=1: the next step's commit decides with the tracker still on the step before,
    while the watcher is naming the step in between. Under its exclusive lock retention reads the tracker
    again, and keeps that step."""
    s1, s2, s3 = (_step(tmp_path, n, manifest=True) for n in (1, 2, 3))
    _tracker(tmp_path, 1)
    decide = retention.retention_plan.plan

    def decide_then_the_watcher_names_step_2(*args, **kwargs):
        decision = decide(*args, **kwargs)
        assert [os.path.basename(os.path.dirname(p)) for p in decision.delete] == ["global_step_2"]
        _tracker(tmp_path, 2)
        return decision

    monkeypatch.setattr(retention.retention_plan, "plan", decide_then_the_watcher_names_step_2)
    kept, deleted = retention.apply([s1, s2, s3], 1)
    assert deleted == [] and os.path.isfile(os.path.join(s2, MANIFEST_NAME))
    monkeypatch.setattr(retention.retention_plan, "plan", decide)
    assert retention.apply([s1, s2, s3], 1)[1] == [s1]  # the next save: the tracker's step 2 stays
