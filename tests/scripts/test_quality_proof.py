"""scripts/compare/quality_proof.py's plan (which runs each variant makes, where the kill goes) and its
reuse of finished variants, without starting verl: `train` is replaced by a recorder."""

from scripts.compare import quality_proof


def test_plan_has_every_variant_and_kills_two_steps_after_the_stop():
    args = quality_proof.parse_args(["--steps", "20", "--stop-at", "10"])
    plan = quality_proof.plan_variants(args, ["a", "b"], ["b"])
    assert [v for v, _, _ in plan] == ["default", "a", "a_resume", "b", "b_resume", "b_sigkill"]
    runs = {v: r for v, _, r in plan}
    assert runs["a"] == [("train", ["trainer.total_training_steps=20"], None)]
    first, resumed = runs["b_resume"]
    assert first[1] == ["trainer.total_training_steps=10"] and first[2] is None
    assert resumed[1] == ["trainer.total_training_steps=20", "trainer.resume_mode=auto"]
    killed, resumed = runs["b_sigkill"]
    assert killed[2] == 12 and resumed[1][-1] == "trainer.resume_mode=auto"
    assert [v for v, _, _ in quality_proof.plan_variants(quality_proof.parse_args(["--no-resume"]), ["a"], [])] == [
        "default",
        "a",
    ]


def test_finished_variant_is_reused_only_with_the_same_settings(tmp_path, monkeypatch):
    calls = []

    def train(log, overrides, env, timeout, kill_at_step=None, ckpt_dir=None):
        calls.append((log.name, overrides))

    monkeypatch.setattr(quality_proof, "train", train)
    args = quality_proof.parse_args(["--algo", "ppo"])
    runs = [("train", ["trainer.total_training_steps=20"], None)]

    def run(common):
        quality_proof.run_variant("quickstart", "quickstart", runs, common, tmp_path, {}, args)

    run(["algo=ppo", "trainer.save_freq=5"])
    assert len(calls) == 1 and "+recipe=quickstart" in calls[0][1]
    assert "trainer.experiment_name=ppo_quickstart" in calls[0][1]
    run(["algo=ppo", "trainer.save_freq=5"])
    assert len(calls) == 1  # done with these settings: reused
    run(["algo=ppo", "trainer.save_freq=4"])
    assert len(calls) == 2  # another setting: run again


def test_runs_get_the_warm_start_they_were_built_for(monkeypatch):
    """train_small.sh rebuilds TINY_ASSETS from TINY_WARMUP_STEPS / TINY_MAX_OPERAND (default: random
    weights) unless they match: every run must be given the ones the proof built."""
    monkeypatch.setenv("RAY_ADDRESS", "elsewhere:6379")
    env = quality_proof.run_env(quality_proof.parse_args(["--warmup-steps", "77", "--max-operand", "6"]))
    assert env["TINY_WARMUP_STEPS"] == "77" and env["TINY_MAX_OPERAND"] == "6"
    assert env["WANDB_MODE"] == "offline" and "RAY_ADDRESS" not in env


def test_kill_waits_for_wandb_to_hold_the_checkpoints_steps(tmp_path, monkeypatch):
    """A SIGKILL loses what wandb has not written yet: the kill waits until its file holds every
    step up to the checkpoint the resumed run starts from (that run logs only the later steps)."""
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    text = "step:11 - global_seqlen/min:1\nstep:12 - global_seqlen/min:1\n"
    logged = set(range(1, 9))
    monkeypatch.setattr(quality_proof, "wandb_steps", lambda wandb_dir: logged)
    assert not quality_proof.kill_now("step:11 - global_seqlen/min:1\n", 12, ckpt, None)  # not there yet
    assert quality_proof.kill_now(text, 12, ckpt, None)  # no checkpoint yet: nothing to lose
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    assert not quality_proof.kill_now(text, 12, ckpt, None)  # steps 9 and 10 only on the console
    logged.update({9, 10})
    assert quality_proof.kill_now(text, 12, ckpt, None)
    assert quality_proof.console_step(text) == 12


def test_the_table_is_headed_by_its_command_and_commit(tmp_path):
    table = tmp_path / "compare_grpo.md"
    table.write_text("| run | steps |\n|---|---|\n")
    quality_proof.add_provenance(table, ["--algo", "grpo", "--steps", "20"], "abc1234")
    text = table.read_text()
    assert text.startswith(
        "Written by `python -m scripts.compare.quality_proof --algo grpo --steps 20` at commit abc1234, "
    )
    assert text.endswith("\n\n| run | steps |\n|---|---|\n") and not (tmp_path / "compare_grpo.md.partial").exists()
