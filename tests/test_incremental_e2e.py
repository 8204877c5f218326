"""verl 0.9.1's real trainer (`python -m verl.trainer.main_ppo` through scripts/train_small.sh, CPU,
GRPO, 2 ranks) with +recipe=incremental and async_save: every step is committed and the tracker
follows the commits; a run resumed from step 2 reproduces step 4 of the uninterrupted run, which
depends on the AdamW state restored at step 2 (step 3's update uses it; measured: equal to ~1e-7
relative with it, 1e-3..1e-1 apart when the optimizer is not restored).

Both runs are tests/verl_runs.py's (`incremental`, shared with tests/test_cpu_e2e.py, and
`incremental_resumed`), started in the background when the session starts.
"""

from __future__ import annotations

import math

import pytest

from slimckpt.format.resume_manifest import MANIFEST_NAME

from .verl_runs import step_metrics

pytestmark = pytest.mark.slow

# metrics of a step that depend on the weights after the previous step's update (i.e. on the Adam moments)
AFTER_UPDATE = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy",
                "rollout_corr/training_log_ppl", "response_length/mean")


def test_incremental_async_commits_and_resumes_exactly(incremental_run, incremental_resumed):
    first_dir, first = incremental_run.ckpt, incremental_run.text
    for step in (1, 2, 3, 4):
        actor = first_dir / f"global_step_{step}" / "actor"
        assert (actor / MANIFEST_NAME).is_file(), step
        assert (actor / "dcp" / ".metadata").is_file() and (actor / "huggingface" / "config.json").is_file()
        assert not list(actor.glob("model_world_size_*.pt"))  # not verl's format
    # verl skips the tracker with async_save; slimckpt's watcher wrote it after each commit
    assert (first_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert "tracker -> step 4 (committed)" in first

    # resumed with resume_mode=resume_path from global_step_2, same settings otherwise
    resumed = incremental_resumed.text
    assert "loaded step 2 from" in resumed
    a, b = step_metrics(first), step_metrics(resumed)
    assert sorted(b) == [3, 4]
    for key in AFTER_UPDATE:
        assert math.isclose(float(a[4][key]), float(b[4][key]), rel_tol=1e-5), (key, a[4][key], b[4][key])
