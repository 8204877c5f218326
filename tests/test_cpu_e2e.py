"""verl 0.9.1's real `python -m verl.trainer.main_ppo`, on this machine's CPU, through
scripts/train_small.sh: GRPO on 2 ranks saving and resuming with +recipe=quickstart, PPO with a
critic and a KL reference model on 1 rank, and rollouts after a resume equal to an uninterrupted
run — which runs +recipe=intermediate (the same training plus an HF export of every actor save),
so the intermediate tier's in-trainer export is checked here too, without a run of its own.

Each run starts a Ray cluster and verl's workers (~45 s of start-up on 2 cores), then trains the
78k-parameter tiny Llama for a few steps of a few seconds each.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import REPO

pytestmark = pytest.mark.slow

SCRIPT = REPO / "scripts" / "train_small.sh"
RUN_TIMEOUT_S = 300
_STEP_LINE = re.compile(r"step:(\d+) - (.*)$")


def train_small(log: Path, *args: str, **env: str) -> str:
    """Run scripts/train_small.sh; return its output (also written to `log`), fail with its tail."""
    # SLIMCKPT_CPU_FORCE: these tests are about the CPU path, also where a GPU is visible
    full_env = {**os.environ, "WANDB_MODE": "offline", "RAY_DEDUP_LOGS": "0", "SLIMCKPT_CPU_FORCE": "1", **env}
    full_env.pop("RAY_ADDRESS", None)
    with open(log, "w") as out:
        proc = subprocess.run(["bash", str(SCRIPT), *args], stdout=out, stderr=subprocess.STDOUT,
                              env=full_env, cwd=log.parent, timeout=RUN_TIMEOUT_S)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"train_small.sh {' '.join(args)} exited {proc.returncode}:\n{text[-6000:]}"
    return text


def step_metrics(text: str) -> dict[int, dict[str, str]]:
    """verl's console logger: one `step:N - key:value - key:value ...` line per step."""
    steps = {}
    for line in text.splitlines():
        match = _STEP_LINE.search(line)
        if match:
            steps[int(match.group(1))] = dict(kv.rsplit(":", 1) for kv in match.group(2).split(" - ") if ":" in kv)
    return steps


def model_shards(step_dir: Path, role: str) -> list[str]:
    return sorted(p.name for p in (step_dir / role).iterdir() if p.suffix == ".pt")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cpu_e2e")


@pytest.fixture(scope="module")
def assets_env(work) -> dict:
    return {"TINY_ASSETS": str(work / "assets"), "NPROC": "2", "ALGO": "grpo"}


CONSOLE = "trainer.logger=[console]"  # no wandb start-up in tests
GRPO = ("+recipe=quickstart", "trainer.save_freq=1", CONSOLE)


@pytest.fixture(scope="module")
def grpo_runs(work, assets_env):
    """Two steps saving at 1 and 2, then a resume (resume_mode=auto) up to step 3."""
    ckpt = work / "grpo_ckpt"
    common = (*GRPO, f"trainer.default_local_dir={ckpt}", f"trainer.rollout_data_dir={work / 'grpo_rollouts'}")
    first = train_small(work / "grpo_first.log", *common, "trainer.total_training_steps=2", **assets_env)
    resumed = train_small(work / "grpo_resume.log", *common, "trainer.total_training_steps=3",
                          "trainer.resume_mode=auto", **assets_env)
    return ckpt, first, resumed


def test_grpo_two_ranks_saves_model_only_and_resumes(grpo_runs):
    ckpt, first, resumed = grpo_runs
    for step in (1, 2, 3):
        step_dir = ckpt / f"global_step_{step}"
        # quickstart: model shards only (no optim_*.pt, no extra_state_*.pt), verl's layout otherwise
        assert model_shards(step_dir, "actor") == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
        assert (step_dir / "actor" / "fsdp_config.json").is_file()
        assert (step_dir / "actor" / "huggingface" / "config.json").is_file()
        assert (step_dir / "data.pt").is_file()
        assert not (step_dir / "critic").exists()  # GRPO: no critic
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"

    assert sorted(step_metrics(first)) == [1, 2]
    assert f"Resuming from {ckpt}/global_step_2" in resumed
    assert sorted(step_metrics(resumed)) == [3]  # it started after step 2 and reached step 3


def rollouts(dump_dir: Path, step: int) -> list[tuple]:
    """verl's trainer.rollout_data_dir dump of one step, as sorted (prompt, response, score) rows."""
    rows = [json.loads(line) for line in (dump_dir / f"{step}.jsonl").read_text().splitlines()]
    return sorted((r["input"], r["output"], r["score"]) for r in rows)


@pytest.fixture(scope="module")
def straight(work, assets_env):
    """Three steps without a stop, saving every step with +recipe=intermediate: training and
    rollouts are quickstart's (the export only reads the fresh shards), plus an HF export per save."""
    ckpt = work / "straight"
    text = train_small(work / "grpo_straight.log", "+recipe=intermediate", "trainer.save_freq=1", CONSOLE,
                       f"trainer.default_local_dir={ckpt}", f"trainer.rollout_data_dir={work / 'straight_rollouts'}",
                       "trainer.total_training_steps=3", **{**assets_env, "SLIMCKPT_MEASURE": "1"})
    return ckpt, text


def test_resumed_rollouts_equal_uninterrupted_ones(work, grpo_runs, straight):
    """Sampling is keyed by (seed, step, sample index, rollout n): the weights loaded from step 2
    give step 3 the same rollouts as a run that never stopped. (quickstart does not restore the
    optimizer, so only what happens before step 3's update can be compared.)"""
    _, first, resumed = grpo_runs
    _, straight_text = straight
    for step in (1, 2, 3):
        expected = rollouts(work / "straight_rollouts", step)
        assert len(expected) == 8 * 5  # 8 prompts, 5 samples each (+algo=grpo)
        assert rollouts(work / "grpo_rollouts", step) == expected, step
    # the samples differ from step to step, so equal dumps are not equal constants
    assert rollouts(work / "straight_rollouts", 2) != rollouts(work / "straight_rollouts", 3)

    # the same from verl's metrics; float sums may differ in the last bit with the batch order
    before_update = ("critic/score/mean", "response_length/mean", "rollout_corr/rollout_log_ppl", "actor/entropy")
    uninterrupted, interrupted = step_metrics(straight_text), {**step_metrics(first), **step_metrics(resumed)}
    for step in (1, 2, 3):
        for key in before_update:
            assert math.isclose(float(interrupted[step][key]), float(uninterrupted[step][key]), rel_tol=1e-5), (step, key)


# --------------------------------------------------------------------------- +recipe=intermediate


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def test_intermediate_every_actor_save_has_a_committed_hf_export(straight):
    ckpt, text = straight
    # the recipe keeps the newest 2: step 1's actor is deleted once step 3 is complete (verl's retention
    # deletes role dirs; the trainer's data.pt stays, as with verl alone)
    assert not (ckpt / "global_step_1" / "actor").exists()
    for step in (2, 3):
        hf = ckpt / f"global_step_{step}" / "actor" / "huggingface"
        names = set(os.listdir(hf))
        assert {"config.json", "manifest.json", "tokenizer.json"} <= names, names
        assert any(n.endswith(".safetensors") for n in names)
        assert not (hf.parent / "huggingface.partial").exists()
        manifest = json.loads((hf / "manifest.json").read_text())
        assert manifest["files"], manifest
        assert not (ckpt / f"global_step_{step}" / "critic" / "huggingface" / "manifest.json").exists()
    assert "HF export" in text
    metrics = json.loads((ckpt / "global_step_2" / "actor" / "slimckpt_save_rank_0.json").read_text())
    assert metrics["recipe"] == "intermediate" and metrics["bytes_written"] > 0


def test_intermediate_export_equals_verls_merger_and_loads(work, straight):
    ckpt, _text = straight
    actor = ckpt / "global_step_3" / "actor"
    reference = work / "verl_merged"
    proc = subprocess.run(
        [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", str(actor),
         "--target_dir", str(reference)],
        env={**os.environ, "SLIMCKPT_DISABLE": "1"}, capture_output=True, text=True, timeout=300)
    ours, theirs = _tensors(actor / "huggingface"), _tensors(reference)
    assert theirs, f"verl's merger wrote nothing (exit {proc.returncode}): {proc.stderr[-2000:]}"
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype == torch.bfloat16, name
        assert torch.equal(ours[name], tensor), name

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(actor / "huggingface")
    state = model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(state[name].to(torch.bfloat16), tensor), name


def test_ppo_with_critic_and_kl_one_rank(work, assets_env):
    ckpt = work / "ppo_ckpt"
    text = train_small(work / "ppo.log", "algo=ppo", "+recipe=quickstart", CONSOLE, "algorithm.use_kl_in_reward=true",
                       "trainer.total_training_steps=2", "trainer.save_freq=2", f"trainer.default_local_dir={ckpt}",
                       **{**assets_env, "NPROC": "1"})
    metrics = step_metrics(text)
    assert sorted(metrics) == [1, 2]
    for key in ("critic/vf_loss", "critic/vpred_mean", "actor/reward_kl_penalty", "critic/advantages/mean"):
        assert key in metrics[2], key
    # step 1 changed the actor and step 2 sampled from the changed weights: the hf rollout's
    # log-probs match the actor's (weights were synced), which they would not with stale weights
    assert float(metrics[1]["actor/grad_norm"]) > 0
    assert float(metrics[2]["training/rollout_probs_diff_max"]) < 1e-4
    step_dir = ckpt / "global_step_2"
    assert model_shards(step_dir, "actor") == ["model_world_size_1_rank_0.pt"]
    assert model_shards(step_dir, "critic") == ["model_world_size_1_rank_0.pt"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
