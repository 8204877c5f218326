"""verl's trainers write latest_checkpointed_iteration.txt with open(path, "w") then write; with
slimckpt's "checkpoint" feature on, that write reaches the disk whole or not at all
(slimckpt.save.driver.tracker_write, patched as the trainer modules' `open`)."""

from __future__ import annotations

import builtins
import inspect
import json
import os
import signal

import pytest

from slimckpt.layout.resume_manifest import TRACKER_NAME
from slimckpt.save.driver.tracker_write import TrackerWrite, wrap_open
from slimckpt.verl.features import register_all
from slimckpt.verl.registry import REGISTRY

from ..conftest import run_python

TRAINER_MODULES = {
    "legacy": "verl.trainer.ppo.ray_trainer",
    "v1": "verl.trainer.ppo.v1.trainer_base",
}


def test_a_tracker_write_reaches_the_disk_at_close_only(tmp_path):
    tracker = tmp_path / TRACKER_NAME
    tracker.write_text("4")
    opened = wrap_open(builtins.open)
    with opened(str(tracker), "w") as f:
        assert isinstance(f, TrackerWrite)
        f.write("5")
        assert tracker.read_text() == "4"  # verl's open would have emptied it by now
    assert tracker.read_text() == "5"
    assert os.listdir(tmp_path) == [TRACKER_NAME]  # no temporary file left


def test_an_exception_inside_the_write_keeps_the_old_tracker(tmp_path):
    tracker = tmp_path / TRACKER_NAME
    tracker.write_text("4")
    with pytest.raises(KeyboardInterrupt), wrap_open(builtins.open)(tracker, "w") as f:
        f.write("5")
        raise KeyboardInterrupt
    assert tracker.read_text() == "4"
    assert os.listdir(tmp_path) == [TRACKER_NAME]


def test_other_files_and_reads_go_to_the_builtin(tmp_path):
    opened = wrap_open(builtins.open)
    (tmp_path / TRACKER_NAME).write_text("3")
    with opened(tmp_path / TRACKER_NAME) as f:
        assert not isinstance(f, TrackerWrite) and f.read() == "3"
    with opened(tmp_path / "data.json", "w") as f:
        assert not isinstance(f, TrackerWrite)
        f.write("{}")
    with opened(tmp_path / TRACKER_NAME, "w", encoding="utf-8") as f:  # not verl's call: left alone
        assert not isinstance(f, TrackerWrite)


@pytest.mark.parametrize("kind", sorted(TRAINER_MODULES))
def test_the_trainers_still_write_the_tracker_with_open(kind):
    """The patch shadows the name the trainer's _save_checkpoint calls; a verl that writes the
    tracker another way must fail here, not silently go back to a non-atomic write."""
    import importlib

    module = importlib.import_module(TRAINER_MODULES[kind])
    trainer = module.PPOTrainer if kind == "v1" else module.RayPPOTrainer
    source = inspect.getsource(trainer._save_checkpoint)
    assert '"latest_checkpointed_iteration.txt"' in source
    assert 'with open(local_latest_checkpointed_iteration, "w") as f:' in source


@pytest.mark.parametrize("kind", sorted(TRAINER_MODULES))
def test_the_patch_shadows_open_in_the_trainer_module_and_reverts(kind):
    import importlib

    register_all()
    name = f"checkpoint.tracker_write.{kind}"
    module = importlib.import_module(TRAINER_MODULES[kind])
    was_applied = REGISTRY.is_applied(name)
    REGISTRY.apply(name)
    try:
        assert module.open.__wrapped__ is builtins.open
    finally:
        if not was_applied:
            REGISTRY.revert(name)
    if not was_applied:
        assert "open" not in vars(module)


# verl's own RayPPOTrainer._save_checkpoint on a stand-in trainer, killed between its open of the
# tracker and its write: the moment a SIGKILL of the trainer lands there
KILLED_IN_TRACKER_WRITE = r"""
import os, sys, types
from omegaconf import OmegaConf
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
if {patched}:
    from slimckpt.verl.features import register_all
    from slimckpt.verl.registry import REGISTRY
    register_all()
    REGISTRY.apply("checkpoint.tracker_write.legacy")
root = {root!r}
trainer = types.SimpleNamespace(
    config=OmegaConf.create({{
        "trainer": {{"default_local_dir": root, "default_hdfs_dir": None}},
        "actor_rollout_ref": {{"actor": {{"checkpoint": {{"async_save": False}}}}}},
    }}),
    global_steps={step},
    actor_rollout_wg=types.SimpleNamespace(save_checkpoint=lambda *a, **k: None),
    use_critic=False,
    train_dataloader=types.SimpleNamespace(state_dict=lambda: {{"step": {step}}}),
)

def kill_at_tracker_write(frame, event, arg):
    if {kill} and event == "c_call" and getattr(arg, "__name__", "") == "write" and frame.f_code.co_name == "_save_checkpoint":
        os.kill(os.getpid(), 9)

sys.setprofile(kill_at_tracker_write)
RayPPOTrainer._save_checkpoint(trainer)
sys.setprofile(None)
"""


def _save(root, step: int, patched: bool, kill: bool):
    code = KILLED_IN_TRACKER_WRITE.format(root=str(root), step=step, patched=patched, kill=kill)
    # the child imports verl's trainer and saves one tracker: seconds; 120 s is a hang
    return run_python(code, env={"SLIMCKPT_DISABLE": "1"} if not patched else {}, timeout=120)


@pytest.mark.parametrize("patched", [False, True], ids=["verl", "slimckpt"])
def test_a_kill_inside_verls_tracker_write(tmp_path, patched):
    """Plain verl: the tracker is left empty (its next resume_mode=auto dies on int('')). Patched:
    the tracker still names the previous step; a save that is not killed names the new one."""
    done = _save(tmp_path, 4, patched, kill=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / TRACKER_NAME).read_text() == "4"
    killed = _save(tmp_path, 5, patched, kill=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (tmp_path / "global_step_5" / "data.pt").exists()  # killed after data.pt, at the tracker
    assert (tmp_path / TRACKER_NAME).read_text() == ("4" if patched else "")
    assert json.dumps(sorted(n for n in os.listdir(tmp_path) if n.startswith(TRACKER_NAME))) == json.dumps(
        [TRACKER_NAME]
    )
