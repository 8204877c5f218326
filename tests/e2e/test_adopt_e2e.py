"""A recipe added to a verl job that already has checkpoints, through verl 0.9.1's real
`python -m verl.trainer.main_ppo` on CPU (tests/helpers/verl_runs.py's adopt_* runs).

adopt_verl trains steps 1-2 with verl's defaults (no recipe, verl's default checkpoint dir). Each
recipe is then added to a relaunch of a copy of those checkpoints with resume_mode=auto: the model-only
recipes move default_local_dir to .../model_only, where verl alone finds nothing and would start
again from step 0. The relaunch must continue from step 2 with the saved weights: its rollouts
(sampling is keyed by seed, step and sample index) equal those of the uninterrupted incremental run
of the same job. Dropping the recipe again stops the run in one line.
"""

import math
from pathlib import Path

import pytest

from ..helpers.verl_runs import ADOPT_RECIPES, step_metrics
from .test_cpu_e2e import rollouts

pytestmark = [pytest.mark.slow, pytest.mark.trainer]

BEFORE_UPDATE = ("critic/score/mean", "response_length/mean", "rollout_corr/rollout_log_ppl", "actor/entropy")


def slim_lines(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if "slimckpt:" in line and needle in line]


def assert_same_training(run, straight, steps) -> None:
    expected = step_metrics(straight.text)
    got = step_metrics(run.text)
    for step in steps:
        assert rollouts(run.rollouts, step) == rollouts(straight.rollouts, step), step
        for key in BEFORE_UPDATE:
            assert math.isclose(float(got[step][key]), float(expected[step][key]), rel_tol=1e-5), (step, key)


def test_verl_default_run_is_the_same_job(adopt_runs, incremental_run):
    """The job the recipes adopt: verl's own format and dir, and the training of the reference run."""
    run = adopt_runs["adopt_verl"]
    assert sorted(step_metrics(run.text)) == [1, 2]
    actor = run.ckpt / "global_step_2" / "actor"
    assert {"model_world_size_2_rank_0.pt", "optim_world_size_2_rank_0.pt", "extra_state_world_size_2_rank_0.pt"} <= {
        p.name for p in actor.iterdir()
    }
    assert (run.ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert_same_training(run, incremental_run, (1, 2))
    assert not slim_lines(run.text, "continues from")


@pytest.mark.parametrize("recipe", ADOPT_RECIPES)
def test_recipe_added_mid_run_continues_from_the_last_step(adopt_runs, incremental_run, recipe):
    run = adopt_runs[f"adopt_{recipe}"]
    last = 4 if recipe == "incremental" else 3
    assert sorted(step_metrics(run.text)) == list(range(3, last + 1))  # never step 1 again
    assert f"Resuming from {run.ckpt}/global_step_2" in run.text
    # the weights (and the data order) of step 2: rollouts of step 3 as the run that never stopped;
    # incremental restores the optimizer as well, so step 4 after its update matches too
    assert_same_training(run, incremental_run, range(3, last + 1))
    if recipe == "incremental":  # same dir as verl's, a format it loads in full: nothing to say
        assert not slim_lines(run.text, "continues from") and not slim_lines(run.text, "does not load")
        assert (run.ckpt / "global_step_3" / "actor" / "dcp").is_dir()
        assert (run.ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
        # verl's steps from before the adoption are not the recipe's to prune (it keeps 2): kept, and named
        for step in (1, 2):
            assert (run.ckpt / f"global_step_{step}" / "actor" / "fsdp_config.json").is_file(), step
        kept = [line for line in run.text.splitlines() if "holds no slimckpt manifest" in line]
        assert any(f"{run.ckpt}/global_step_1/actor" in line for line in kept), run.text[-3000:]
        return
    moved = slim_lines(run.text, "continues from")
    assert len(moved) == 1, moved
    assert f"+recipe={recipe} continues from {run.ckpt}/global_step_2" in moved[0]
    assert f"new steps go to {run.ckpt}/model_only" in moved[0]
    assert "does not load actor optimizer+extra" in moved[0]
    saved = run.ckpt / "model_only"
    assert (saved / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    names = {p.name for p in (saved / "global_step_3" / "actor").iterdir()}
    assert "model_world_size_2_rank_0.pt" in names and not any(n.startswith("optim_") for n in names)
    if recipe == "intermediate":  # its export of the first save after the adoption, committed
        assert (saved / "global_step_3" / "actor" / "huggingface" / "manifest.json").is_file()
    # what the recipe sets outside the checkpoint sections, in one line (save_freq is the run's own)
    settings = slim_lines(run.text, f"+recipe={recipe} also sets")
    assert len(settings) == 1, settings
    assert "trainer.max_actor_ckpt_to_keep=2 (verl's default: null)" in settings[0]
    assert f"trainer.default_local_dir=checkpoints/adopt/{recipe}/model_only" in settings[0]
    assert "save_freq" not in settings[0]


@pytest.mark.parametrize(
    "recipe, why",
    [
        ("quickstart", "holds model only"),
        ("incremental", "is in slimckpt's incremental format (dcp/)"),
    ],
)
def test_dropping_the_recipe_stops_in_one_line(adopt_runs, recipe, why):
    run = adopt_runs[f"adopt_plain_after_{recipe}"]
    lines = slim_lines(run.text, why)
    assert len(lines) == 1, run.text[-3000:]
    assert f"+recipe={recipe}" in lines[0]
    assert "Traceback" not in run.text
    assert not step_metrics(run.text)  # it stopped before training, and saved nothing
    where = Path(run.ckpt) / ("model_only" if recipe == "quickstart" else "")
    assert (where / "latest_checkpointed_iteration.txt").read_text().strip() == ("3" if recipe == "quickstart" else "4")
