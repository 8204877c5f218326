"""slimckpt.options.checkpoint_options.role_options and async_mode: a role's checkpoint section found the same way in the trainer's
DictConfig and in the plain dict verl's Tracking is given, read as options_of reads it."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from slimckpt.options.checkpoint_options import ROLE_KEYS, ROLE_SECTIONS, async_mode, role_options, roles_in_use

SLIM = {"_target_": "slimckpt.verl.checkpoint_config.SlimCheckpointConfig"}
VERL = {"_target_": "verl.trainer.config.CheckpointConfig"}


def _config(actor: dict, critic: dict | None) -> dict:
    config = {"actor_rollout_ref": {"actor": {"checkpoint": actor}}, "trainer": {"default_local_dir": "ckpts"}}
    if critic is not None:
        config["critic"] = {"checkpoint": critic}
    return config


@pytest.mark.parametrize("as_dictconfig", [False, True], ids=["dict", "DictConfig"])
def test_each_roles_section_is_read_with_the_configs_defaults_and_spellings(as_dictconfig):
    raw = _config(
        {**SLIM, "keep_best": "2", "best_metric": "val/score"},
        {**SLIM, "incremental_save": "true", "async_save": "true"},
    )
    config = OmegaConf.create(raw) if as_dictconfig else raw
    actor, critic = role_options(config, "actor"), role_options(config, "critic")
    assert actor.keep_best == 2 and actor.best_metric == "val/score" and actor.async_save == "off"
    assert critic.async_save == "pool" and critic.keep_best == 0


def test_verls_own_section_a_missing_role_and_a_non_mapping_read_as_none():
    config = _config(VERL, None)
    assert role_options(config, "actor") is None
    assert role_options(config, "critic") is None
    assert role_options({"actor_rollout_ref": {"actor": None}}, "actor") is None
    assert role_options({"critic": {"checkpoint": "not a section"}}, "critic") is None
    assert set(ROLE_SECTIONS) == {"actor", "critic"}


def test_the_dotted_keys_select_the_same_sections_and_a_critic_is_read_only_with_one():
    config = OmegaConf.create(_config({**SLIM, "keep_best": "2", "best_metric": "m"}, VERL))
    assert ROLE_KEYS == {"actor": "actor_rollout_ref.actor.checkpoint", "critic": "critic.checkpoint"}
    assert OmegaConf.select(config, ROLE_KEYS["actor"]).keep_best == "2"
    assert OmegaConf.select(config, ROLE_KEYS["critic"])._target_ == VERL["_target_"]
    assert roles_in_use(False) == ("actor",) and roles_in_use(True) == ("actor", "critic")


def test_a_bad_value_is_refused_as_the_config_class_refuses_it():
    with pytest.raises(ValueError, match="async_save"):
        role_options(_config({**SLIM, "async_save": "sometimes"}, None), "actor")


def test_async_mode_reads_every_spelling():
    assert [async_mode(v) for v in (None, False, "false", True, "true", "pool", "stream", "Stream")] == [
        "off",
        "off",
        "off",
        "pool",
        "pool",
        "pool",
        "stream",
        "stream",
    ]
