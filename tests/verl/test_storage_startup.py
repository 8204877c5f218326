"""verl/storage_startup: on trainer.default_local_dir=s3://..., the start-up refuses what cannot save there in
one line, turns off what would rewrite a committed step, and forwards the AWS variables but never a secret."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from slimckpt.verl import storage_startup
from slimckpt.verl.recipes import CONF_DIR

from ..save.test_trainer_storage import ROOT


def _config(recipe: str | None, root: str = ROOT, **checkpoint) -> object:
    base = {"trainer": {"default_local_dir": root, "default_hdfs_dir": None}, "ray_kwargs": {"ray_init": {}}}
    config = OmegaConf.create(base)
    if recipe:
        config = OmegaConf.merge(config, OmegaConf.load(CONF_DIR / "recipe" / f"{recipe}.yaml"))
    OmegaConf.update(config, "trainer.default_local_dir", root)  # given after the recipe, as a user does
    for key, value in checkpoint.items():
        OmegaConf.update(config, f"actor_rollout_ref.actor.checkpoint.{key}", value, force_add=True)
    return config


@pytest.mark.parametrize("recipe", ["quickstart", "intermediate", None])
def test_verls_rank_files_on_object_storage_are_refused_in_one_line(recipe):
    with pytest.raises(SystemExit) as stopped:
        storage_startup.on_object_storage(_config(recipe), use_critic=False)
    line = str(stopped.value.code)
    assert "\n" not in line and line.startswith(f"slimckpt: trainer.default_local_dir={ROOT}: ")
    assert "use +recipe=incremental" in line and (f"+recipe={recipe}" in line if recipe else "verl's own" in line)


def test_a_local_dir_is_left_to_adopt():
    assert storage_startup.on_object_storage(_config("quickstart", root="/tmp/ckpt"), use_critic=False) is False


def test_the_recipes_optimizer_drop_is_turned_off_on_object_storage():
    """The recipe keeps the optimizer in the newest step only (keep_optimizer_last=1), which rewrites a
    committed step: on a bucket the kept steps stay whole instead, said in one line; the run starts."""
    config = _config("incremental")
    assert config.actor_rollout_ref.actor.checkpoint.keep_optimizer_last == 1
    assert storage_startup.refusal(config, use_critic=True) is None
    line = storage_startup.turn_optimizer_drop_off(config, use_critic=True)
    assert config.actor_rollout_ref.actor.checkpoint.keep_optimizer_last is None
    assert config.critic.checkpoint.keep_optimizer_last is None
    assert "\n" not in line and "critic.checkpoint.keep_optimizer_last=null on s3://ckpts/run" in line
    assert "trainer.max_actor_ckpt_to_keep=2" in line
    assert storage_startup.turn_optimizer_drop_off(config, use_critic=True) is None


def test_an_asynchronous_trainer_mode_is_refused_on_object_storage():
    config = _config("incremental")
    OmegaConf.update(config, "trainer.v1.trainer_mode", "fully_async", force_add=True)
    assert "trainer.v1.trainer_mode=sync" in storage_startup.refusal(config, use_critic=False)


def test_the_recipes_default_export_is_turned_off_naming_the_merge():
    config = _config("incremental")
    assert config.actor_rollout_ref.actor.checkpoint.export_hf is True
    line = storage_startup.turn_export_off(config)
    assert config.actor_rollout_ref.actor.checkpoint.export_hf is False
    assert f"slimckpt merge --local_dir {ROOT}/global_step_N/actor" in line
    assert storage_startup.turn_export_off(config) is None  # said once


def test_aws_variables_reach_every_worker_but_never_a_secret(monkeypatch):
    env = {"AWS_ENDPOINT_URL": "http://s3:9000", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t", "HOME": "/"}
    assert storage_startup.forwarded_env(env) == {"AWS_ENDPOINT_URL": "http://s3:9000"}
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://s3:9000")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "never-in-the-config")
    config = _config("incremental")
    OmegaConf.update(config, "ray_kwargs.ray_init.runtime_env.env_vars.AWS_REGION", "us-east-1", force_add=True)
    assert storage_startup.forward_env(config) == ["AWS_ENDPOINT_URL"]  # a value the config sets wins
    env_vars = OmegaConf.to_container(config.ray_kwargs.ray_init.runtime_env.env_vars)
    assert env_vars["AWS_ENDPOINT_URL"] == "http://s3:9000" and env_vars["AWS_REGION"] == "us-east-1"
    assert env_vars["SLIMCKPT_CHECKPOINT"] == "1" and "never-in-the-config" not in str(OmegaConf.to_yaml(config))
