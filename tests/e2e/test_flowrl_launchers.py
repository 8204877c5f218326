"""algo=flowrl through both launchers' --dry-run: the composed config selects FlowRL's loss config
and the ckpt/* metrics callback, and `slimckpt dryrun` validates it (loss 'flowrl' registered)."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from ..conftest import REPO


def _dry_run(script: str, *args: str, env: dict | None = None) -> dict:
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    for knob in ("NNODES", "GPUS_PER_NODE", "MODEL_PATH", "DATA_DIR", "ALGO", "SLIMCKPT_MEASURE", "WANDB_MODE"):
        if knob not in (env or {}):
            full_env.pop(knob, None)
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / script), "algo=flowrl", "--dry-run", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=REPO,
        # a dry run imports verl and composes its config in seconds; 300 s is a hang
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("config OK"), proc.stdout[-2000:]
    return yaml.safe_load("\n".join(lines[:-1]))


def _assert_flowrl(cfg: dict, beta: float = 15.0) -> None:
    actor = cfg["actor_rollout_ref"]["actor"]
    assert actor["policy_loss"]["_target_"] == "slimckpt_flowrl.config.FlowRLLossConfig"
    assert actor["policy_loss"]["loss_mode"] == "flowrl" and actor["policy_loss"]["beta"] == beta
    assert actor["use_kl_loss"] is True and actor["kl_loss_coef"] == 0.0  # ref model on, verl's KL term off
    assert cfg["algorithm"]["adv_estimator"] == "grpo" and cfg["critic"]["enable"] is False
    assert cfg["trainer"]["checkpoint_callback_class"] == "slimckpt.verl.ckpt_metrics.CheckpointMetricsCallback"


def test_train_70b_flowrl_with_a_recipe():
    cfg = _dry_run("train_70b.sh", "+recipe=quickstart", "actor_rollout_ref.actor.policy_loss.beta=10")
    _assert_flowrl(cfg, beta=10)  # the user's override wins over the algo file
    assert cfg["trainer"]["experiment_name"] == "70b_flowrl"
    # measuring and offline wandb reach every worker on every node through Ray's runtime_env
    assert cfg["ray_kwargs"]["ray_init"]["runtime_env"]["env_vars"] == {
        "SLIMCKPT_MEASURE": "1",
        "WANDB_MODE": "offline",
    }


def test_train_small_flowrl():
    cfg = _dry_run("train_small.sh", "+recipe=quickstart")
    _assert_flowrl(cfg)
    assert cfg["trainer"]["logger"] == ["console", "wandb"]
