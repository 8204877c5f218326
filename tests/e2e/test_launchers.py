"""The launchers' --dry-run: the same overrides as a real run, composed and validated by
`slimckpt dryrun` on this CPU machine (no GPU, no model files, no Ray)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.launch import REPO

TRAIN_70B = REPO / "scripts" / "train_70b.sh"
TRAIN_SMALL = REPO / "scripts" / "train_small.sh"


# a dry run imports verl and composes its config in seconds; 300 s is a hang
def _run(script: Path, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    # PYTHON: the scripts default to python3 on PATH; here it must be this venv's interpreter
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    for knob in ("NNODES", "GPUS_PER_NODE", "MODEL_PATH", "DATA_DIR", "ALGO"):
        if knob not in (env or {}):
            full_env.pop(knob, None)
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, env=full_env, cwd=REPO, timeout=timeout
    )


def _composed(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("config OK"), proc.stdout[-2000:]
    return yaml.safe_load("\n".join(lines[:-1]))


def test_train_70b_dry_run_ppo():
    cfg = _composed(_run(TRAIN_70B, "--dry-run", "+recipe=quickstart"))
    arr = cfg["actor_rollout_ref"]
    assert arr["model"]["path"] == "Qwen/Qwen2-72B-Instruct"
    assert arr["actor"]["fsdp_config"]["param_offload"] is True
    assert arr["actor"]["fsdp_config"]["optimizer_offload"] is True
    assert arr["actor"]["use_dynamic_bsz"] is True
    assert arr["ref"]["fsdp_config"]["param_offload"] is True
    assert arr["rollout"]["name"] == "vllm"
    assert arr["rollout"]["tensor_model_parallel_size"] == 8
    assert arr["rollout"]["n_gpus_per_node"] == 8  # verl's interpolation, resolved
    assert cfg["trainer"]["nnodes"] == 4 and cfg["trainer"]["n_gpus_per_node"] == 8
    assert cfg["algorithm"]["adv_estimator"] == "gae" and cfg["critic"]["enable"] is True
    assert cfg["critic"]["model"]["path"] == "Qwen/Qwen2-72B-Instruct"
    assert cfg["critic"]["fsdp"]["param_offload"] is True
    assert cfg["data"]["train_files"] == os.path.expanduser("~/data/gsm8k/train.parquet")
    # the recipe passed through "$@"
    assert arr["actor"]["checkpoint"]["_target_"] == "slimckpt.verl.checkpoint_config.SlimCheckpointConfig"
    assert arr["actor"]["checkpoint"]["save_contents"] == ["model"]
    assert cfg["trainer"]["save_freq"] == 10


def test_train_70b_dry_run_grpo_with_knobs():
    env = {"NNODES": "2", "GPUS_PER_NODE": "8", "MODEL_PATH": "/shared/Llama-3.3-70B", "DATA_DIR": "/shared/data"}
    cfg = _composed(_run(TRAIN_70B, "algo=grpo", "+recipe=quickstart", "--dry-run", "trainer.save_freq=7", env=env))
    assert cfg["algorithm"]["adv_estimator"] == "grpo"
    assert cfg["critic"]["enable"] is False
    assert cfg["actor_rollout_ref"]["rollout"]["n"] == 5
    assert cfg["actor_rollout_ref"]["actor"]["use_kl_loss"] is True
    assert cfg["trainer"]["nnodes"] == 2
    assert cfg["actor_rollout_ref"]["model"]["path"] == "/shared/Llama-3.3-70B"
    assert cfg["critic"]["model"]["path"] == "/shared/Llama-3.3-70B"
    assert cfg["data"]["val_files"] == "/shared/data/test.parquet"
    assert cfg["trainer"]["save_freq"] == 7  # the user's override wins over the recipe's
    assert cfg["trainer"]["experiment_name"] == "70b_grpo"


def test_train_70b_cluster_argument_decides_unless_knobs_are_set():
    proc = _run(
        TRAIN_70B,
        "--dry-run",
        "--no-validate",
        "--show",
        "trainer.nnodes,trainer.n_gpus_per_node",
        "+cluster=1x8",
        "+recipe=quickstart",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[:2] == ["trainer.nnodes: 1", "trainer.n_gpus_per_node: 8"]


def test_train_70b_dry_run_broken_override_is_one_readable_line():
    proc = _run(TRAIN_70B, "--dry-run", "+recipe=quickstart", "trainer.save_frq=3")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("slimckpt.dryrun:")]
    assert errors == [
        "slimckpt.dryrun: config error: trainer.save_frq is not a key of verl's config "
        "(did you mean trainer.save_freq?); to add a new key on purpose write +trainer.save_frq=3"
    ]
    assert "config OK" not in proc.stdout


def test_train_70b_dry_run_rejects_what_verl_would():
    # composes fine, but verl's workers would reject the layout: 32 GPUs in engines of TP 3 (exit 1)
    proc = _run(
        TRAIN_70B,
        "--dry-run",
        "--no-print",
        "+recipe=quickstart",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=3",
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "not divisible by tensor x data x pipeline parallel = 3" in proc.stderr


def test_train_70b_rejects_unknown_algo_before_python():
    proc = _run(TRAIN_70B, "--dry-run", env={"ALGO": "dpo", "PYTHON": "/nonexistent/python"})
    assert proc.returncode == 2
    assert "ALGO/algo=dpo is not supported" in proc.stderr


@pytest.mark.skipif(not TRAIN_SMALL.exists(), reason="scripts/train_small.sh not written yet")
def test_train_small_dry_run():
    proc = _run(TRAIN_SMALL, "--dry-run", "+recipe=quickstart")
    cfg = _composed(proc)
    assert (
        cfg["actor_rollout_ref"]["actor"]["checkpoint"]["_target_"]
        == "slimckpt.verl.checkpoint_config.SlimCheckpointConfig"
    )
    assert cfg["trainer"]["device"] == "cpu"
