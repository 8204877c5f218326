"""verl 0.9.1's real `python -m verl.trainer.main_ppo`, on this machine's CPU, through
scripts/train_small.sh: GRPO on 2 ranks stopped after step 3 and resumed (resume_mode=auto) to
step 4, PPO with a critic and a KL reference model on 1 rank, and rollouts after the resume equal
to an uninterrupted run's.

The stopped run saves with +recipe=intermediate (quickstart's model-only saves plus an HF export
of every actor save), so the intermediate tier's in-trainer export and its retention are checked
on it; the resumed run saves with +recipe=quickstart (the same model-only format: a user may drop
the export at a restart). The uninterrupted reference is the incremental tier's run of
tests/helpers/verl_runs.py (training does not depend on the recipe), which tests/e2e/test_incremental_e2e.py
checks too: one verl start-up serves both modules.

The runs are tests/helpers/verl_runs.py's (RUNS), started in the background when the session starts; each
starts a Ray cluster and verl's workers (~50 s of start-up on 2 cores), then trains the 78k-parameter
tiny Llama for a few steps of a few seconds each.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slimckpt.observe.save_reports import REPORTS_DIR

from ..helpers.verl_runs import step_metrics

pytestmark = [pytest.mark.slow, pytest.mark.trainer]


def model_shards(step_dir: Path, role: str) -> list[str]:
    return sorted(p.name for p in (step_dir / role).iterdir() if p.suffix == ".pt")


def test_grpo_two_ranks_saves_model_only_and_resumes(grpo_runs):
    ckpt, first, resumed = grpo_runs.ckpt, grpo_runs.first, grpo_runs.resumed
    # step 1's actor went to retention (test_intermediate_every_actor_save_has_a_committed_hf_export)
    for step in (2, 3, 4):
        step_dir = ckpt / f"global_step_{step}"
        # model shards only (no optim_*.pt, no extra_state_*.pt), verl's layout otherwise
        assert model_shards(step_dir, "actor") == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]
        assert (step_dir / "actor" / "fsdp_config.json").is_file()
        assert (step_dir / "actor" / "huggingface" / "config.json").is_file()
        assert (step_dir / "data.pt").is_file()
        assert not (step_dir / "critic").exists()  # GRPO: no critic
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    # step 4 is quickstart's save: no HF export, and its save report names the recipe
    assert not (ckpt / "global_step_4" / "actor" / "huggingface" / "manifest.json").exists()
    report = json.loads((ckpt / REPORTS_DIR / "global_step_4" / "actor" / "rank_0.save.json").read_text())
    assert report["recipe"] == "quickstart" and report["global_step"] == 4

    assert sorted(step_metrics(first)) == [1, 2, 3]
    assert f"Resuming from {ckpt}/global_step_3" in resumed
    assert sorted(step_metrics(resumed)) == [4]  # it started after step 3 and reached step 4


def rollouts(dump_dir: Path, step: int) -> list[tuple]:
    """verl's trainer.rollout_data_dir dump of one step, as sorted (prompt, response, score) rows."""
    rows = [json.loads(line) for line in (dump_dir / f"{step}.jsonl").read_text().splitlines()]
    return sorted((r["input"], r["output"], r["score"]) for r in rows)


def test_resumed_rollouts_equal_uninterrupted_ones(grpo_runs, incremental_run):
    """Sampling is keyed by (seed, step, sample index, rollout n): the weights loaded from step 3
    give step 4 the same rollouts as a run that never stopped. (quickstart does not restore the
    optimizer, so only what happens before step 4's update can be compared.) Steps 1-3 are two
    separate runs with different recipes: equal too."""
    first, resumed, straight = grpo_runs.first, grpo_runs.resumed, incremental_run.rollouts
    for step in (1, 2, 3, 4):
        expected = rollouts(straight, step)
        assert len(expected) == 8 * 5  # 8 prompts, 5 samples each (+algo=grpo)
        assert rollouts(grpo_runs.rollouts, step) == expected, step
    # the samples differ from step to step, so equal dumps are not equal constants
    assert rollouts(straight, 2) != rollouts(straight, 3) != rollouts(straight, 4)

    # the same from verl's metrics; float sums may differ in the last bit with the batch order
    before_update = ("critic/score/mean", "response_length/mean", "rollout_corr/rollout_log_ppl", "actor/entropy")
    uninterrupted, interrupted = step_metrics(incremental_run.text), {**step_metrics(first), **step_metrics(resumed)}
    for step in (1, 2, 3, 4):
        for key in before_update:
            assert math.isclose(float(interrupted[step][key]), float(uninterrupted[step][key]), rel_tol=1e-5), (
                step,
                key,
            )


# --------------------------------------------------------------------------- +recipe=intermediate


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def test_intermediate_every_actor_save_has_a_committed_hf_export(grpo_runs):
    ckpt, first, after_first = grpo_runs.ckpt, grpo_runs.first, grpo_runs.after_first
    # the recipe keeps the newest 2: step 1's actor is deleted once step 3 is complete (verl's retention
    # deletes role dirs; the trainer's data.pt stays, as with verl alone)
    assert "actor" not in after_first[1] and "data.pt" in after_first[1], after_first
    assert "actor" in after_first[2] and "actor" in after_first[3]
    for step in (2, 3):
        hf = ckpt / f"global_step_{step}" / "actor" / "huggingface"
        names = set(os.listdir(hf))
        assert {"config.json", "manifest.json", "tokenizer.json"} <= names, names
        assert any(n.endswith(".safetensors") for n in names)
        assert not (hf.parent / "huggingface.partial").exists()
        manifest = json.loads((hf / "manifest.json").read_text())
        assert manifest["files"], manifest
        assert not (ckpt / f"global_step_{step}" / "critic" / "huggingface" / "manifest.json").exists()
    assert "HF export" in first
    metrics = json.loads((ckpt / REPORTS_DIR / "global_step_2" / "actor" / "rank_0.save.json").read_text())
    assert metrics["recipe"] == "intermediate" and metrics["bytes_written"] > 0


def test_intermediate_export_equals_verls_merger_and_loads(grpo_runs, tmp_path):
    actor = grpo_runs.ckpt / "global_step_3" / "actor"
    reference = tmp_path / "verl_merged"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl.model_merger",
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            str(actor),
            "--target_dir",
            str(reference),
        ],
        env={**os.environ, "SLIMCKPT_DISABLE": "1"},
        capture_output=True,
        text=True,
        # verl's merger imports verl and merges a tiny checkpoint: seconds; 300 s is a hang
        timeout=300,
    )
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


def test_ppo_with_critic_and_kl_one_rank(ppo_run):
    ckpt, text = ppo_run.ckpt, ppo_run.text
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


# run-specific by nature: wall times, throughput, memory, the save's own metrics
NOT_TRAINING = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/", "critic/perf/", "ckpt/")
