"""verl 0.9.1's real trainer (`python -m verl.trainer.main_ppo` through scripts/train_small.sh, CPU,
GRPO, 2 ranks) with +recipe=incremental and async_save: every step is committed and the tracker
follows the commits; a run resumed from step 2 reproduces step 4 of the uninterrupted run, which
depends on the AdamW state restored at step 2 (step 3's update uses it; measured: equal to ~1e-7
relative with it, 1e-3..1e-1 apart when the optimizer is not restored).

Both runs are tests/helpers/verl_runs.py's (`incremental`, shared with tests/e2e/test_cpu_e2e.py, and
`incremental_resumed`), started in the background when the session starts; they are the only two that
`make test` starts.
"""

from __future__ import annotations

import math

import pytest

from slimckpt.layout.resume_manifest import MANIFEST_NAME
from slimckpt.observe.save_reports import read_reports

from ..helpers.verl_runs import step_metrics

pytestmark = pytest.mark.slow

# metrics of a step that depend on the weights after the previous step's update (i.e. on the Adam moments)
AFTER_UPDATE = (
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/entropy",
    "rollout_corr/training_log_ppl",
    "response_length/mean",
)


# the one trainer test `make test` keeps (no `trainer` marker): +recipe=incremental saved by verl's trainer and
# resumed by it, optimizer included, in two runs
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


@pytest.mark.trainer
def test_async_save_metrics_come_with_the_commit(incremental_run):
    """An async save once reported its blocking seconds as `seconds`, bytes before its files
    existed and an RSS window that missed the background write."""
    logged = {
        step: {k: float(v) for k, v in metrics.items() if k.startswith("ckpt/")}
        for step, metrics in step_metrics(incremental_run.text).items()
    }
    ckpt = incremental_run.ckpt
    assert sorted(logged) == [1, 2, 3, 4]
    for step, metrics in logged.items():
        assert metrics["ckpt/blocking_seconds"] > 0 and metrics["ckpt/ranks"] == 2
        if "ckpt/committed_step" in metrics:  # a write that committed by this save
            assert metrics["ckpt/committed_step"] <= step
            assert metrics["ckpt/write_seconds"] > 0 and metrics["ckpt/bytes_gb"] > 0
            assert metrics["ckpt/staging_pool_gb"] > 0
            assert metrics["ckpt/seconds"] > metrics["ckpt/write_seconds"]
    committed = sorted(int(m["ckpt/committed_step"]) for m in logged.values() if "ckpt/committed_step" in m)
    assert committed and len(set(committed)) == len(committed), committed  # each commit logged once at most
    for step in (1, 2, 3, 4):  # step 4's write commits at exit, after the last on_save: its reports have it
        step_dir = ckpt / f"global_step_{step}"
        saves, commits = read_reports(str(step_dir), step), read_reports(str(step_dir), step, kind="commit")
        assert len(saves) == 2 and all(r["async"] and not r["committed"] and r["bytes_written"] is None for r in saves)
        assert len(commits) == 2 and all(r["committed"] and r["bytes_written"] > 0 for r in commits)
        assert not list((step_dir / "actor").glob("slimckpt_save_rank_*"))


@pytest.mark.trainer
def test_a_save_before_the_actors_first_update_changes_no_metric(ppo_warmup):
    """PPO (critic, KL in the reward) with trainer.critic_warmup=2 saving every step: the actor's step-1
    save comes before its first optimizer step. With +recipe=incremental (export on) every training
    metric of every step equals verl's own run; a save that stepped the optimizer (Adam's step count 1
    before the first update) changes step 3's. Two runs of one PPO config must repeat bit for bit for
    this to hold (the critic's value head seeded by overrides/cluster/cpu.yaml): no other test runs PPO twice."""
    from .test_cpu_e2e import NOT_TRAINING

    verl, ours = (step_metrics(run.text) for run in ppo_warmup)
    assert sorted(verl) == sorted(ours) == [1, 2, 3]
    assert "actor/pg_loss" not in verl[1] and "actor/pg_loss" in verl[2]  # no actor update at step 1
    actor = ppo_warmup[1].ckpt / "global_step_1" / "actor"
    assert (actor / MANIFEST_NAME).is_file() and list((actor / "huggingface").glob("*.safetensors"))
    assert (ppo_warmup[1].ckpt / "global_step_1" / "critic" / MANIFEST_NAME).is_file()
    for step in verl:
        keys = sorted(k for k in verl[step] if not k.startswith(NOT_TRAINING))
        assert "critic/values/mean" in keys and "actor/reward_kl_penalty" in keys
        differ = [k for k in keys if verl[step][k] != ours[step].get(k)]
        assert not differ, (
            f"step {step}: {differ[:5]} differ, e.g. {verl[step][differ[0]]} vs {ours[step].get(differ[0])}"
        )


@pytest.mark.trainer
def test_a_step_converted_back_to_verl_resumes_without_the_recipe(incremental_run, convert_back_run):
    """Leaving the incremental tier: `slimckpt convert` writes step 2 as verl's rank files for 2 ranks,
    and a run without the recipe (verl's own FSDPCheckpointManager.load_checkpoint) continues it:
    steps 3 and 4 log bit for bit what the run that never stopped logged."""
    step = convert_back_run.ckpt / "global_step_2"
    assert (convert_back_run.ckpt / "latest_checkpointed_iteration.txt").read_text().strip() in ("2", "4")
    for rank in range(2):
        for kind in ("model", "optim", "extra_state"):
            assert (step / "actor" / f"{kind}_world_size_2_rank_{rank}.pt").is_file(), (kind, rank)
    assert not (step / "actor" / "dcp").exists() and (step / "data.pt").is_file()
    a, b = step_metrics(incremental_run.text), step_metrics(convert_back_run.text)
    assert sorted(b) == [3, 4], sorted(b)  # resumed at step 2, not from scratch
    for s in (3, 4):
        for key in AFTER_UPDATE:
            assert a[s][key] == b[s][key], (s, key, a[s][key], b[s][key])  # as logged: full float repr
