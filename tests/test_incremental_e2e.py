"""verl 0.9.1's real trainer (`python -m verl.trainer.main_ppo` through scripts/train_small.sh, CPU,
GRPO, 2 ranks) with +recipe=incremental and async_save: every step is committed and the tracker
follows the commits; a run resumed from step 1 reproduces step 3 of the uninterrupted run, which
depends on the restored AdamW state (measured here: equal to ~1e-7 relative with it, 1e-3..1e-1
apart when the optimizer is not restored).

Two runs of verl's trainer: ~2.5 minutes on 2 cores.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from slimckpt.resume_manifest import MANIFEST_NAME

from .test_cpu_e2e import step_metrics, train_small

pytestmark = pytest.mark.slow

ASYNC = ("+recipe=incremental", "actor_rollout_ref.actor.checkpoint.async_save=true", "trainer.save_freq=1",
         "trainer.total_training_steps=3")
# metrics of step 3 that depend on the weights after step 2's update (i.e. on the Adam moments)
AFTER_UPDATE = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy",
                "rollout_corr/training_log_ppl", "response_length/mean")


def test_incremental_async_commits_and_resumes_exactly(tmp_path: Path):
    env = {"TINY_ASSETS": str(tmp_path / "assets"), "NPROC": "2", "ALGO": "grpo"}
    first_dir = tmp_path / "ckpt"
    first = train_small(tmp_path / "first.log", *ASYNC, f"trainer.default_local_dir={first_dir}", **env)
    for step in (1, 2, 3):
        actor = first_dir / f"global_step_{step}" / "actor"
        assert (actor / MANIFEST_NAME).is_file(), step
        assert (actor / "dcp" / ".metadata").is_file() and (actor / "huggingface" / "config.json").is_file()
        assert not list(actor.glob("model_world_size_*.pt"))  # not verl's format
    # verl skips the tracker with async_save; slimckpt's watcher wrote it after each commit
    assert (first_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert "tracker -> step 3 (committed)" in first

    resumed = train_small(tmp_path / "resumed.log", *ASYNC, f"trainer.default_local_dir={tmp_path / 'ckpt_b'}",
                          "trainer.resume_mode=resume_path",
                          f"trainer.resume_from_path={first_dir / 'global_step_1'}", **env)
    assert "loaded step 1 from" in resumed
    a, b = step_metrics(first), step_metrics(resumed)
    assert sorted(b) == [2, 3]
    for key in AFTER_UPDATE:
        assert math.isclose(float(a[3][key]), float(b[3][key]), rel_tol=1e-5), (key, a[3][key], b[3][key])
