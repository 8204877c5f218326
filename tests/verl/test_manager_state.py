"""What slimckpt keeps on verl's manager (verl.manager_state) and the typed SlimCheckpointConfig it
resolves: one attribute on verl's real FSDPCheckpointManager class, a recipe's config as it is,
verl's own config as the dataclass's defaults, every field declared once with its docstring."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from types import SimpleNamespace

import pytest
from verl.trainer.config.config import CheckpointConfig

import slimckpt.options.checkpoint_options as cc
from slimckpt.options.checkpoint_options import CheckpointOptions
from slimckpt.save.target import TargetState as ManagerState
from slimckpt.verl.checkpoint_config import SlimCheckpointConfig
from slimckpt.verl.manager_state import config_of, default_config, state_of


@pytest.fixture
def no_switch_on(monkeypatch):
    """Build SlimCheckpointConfig in this process without applying the checkpoint patches."""
    from slimckpt.verl import features

    calls: list[str] = []
    monkeypatch.setattr(features, "switch_on", lambda feature: calls.append(feature))
    return calls


def _manager(config):
    """verl's real manager class, built without a model (its __init__ needs one): the attributes
    slimckpt's code reads of it are verl's own."""
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    manager = FSDPCheckpointManager.__new__(FSDPCheckpointManager)
    manager.checkpoint_config = config
    return manager


def test_the_state_is_one_attribute_made_once(no_switch_on):
    manager = _manager(SlimCheckpointConfig(recipe="incremental", incremental_save=True))
    before = set(vars(manager))
    state = state_of(manager)
    assert isinstance(state, ManagerState) and state_of(manager) is state
    assert set(vars(manager)) - before == {"_slimckpt_state"}
    assert state.note_once("x") and not state.note_once("x") and state.note_once("y")


def test_config_of_a_recipe_is_its_own_and_follows_a_swap(no_switch_on):
    first = SlimCheckpointConfig(recipe="incremental", incremental_save=True, verify=False)
    manager = _manager(first)
    assert config_of(manager) is first
    second = SlimCheckpointConfig(recipe="incremental", incremental_save=True, async_save="stream")
    manager.checkpoint_config = second  # a tool or test swapping recipes on one manager
    assert config_of(manager) is second and config_of(manager).async_save == "stream"


@pytest.mark.parametrize("raw", [CheckpointConfig(), None])
def test_verls_own_config_reads_as_the_dataclass_defaults(no_switch_on, raw):
    manager = _manager(raw)
    config = config_of(manager)
    assert isinstance(config, SlimCheckpointConfig) and config is default_config()
    for f in (f for f in dataclasses.fields(SlimCheckpointConfig) if f.name in CheckpointOptions.__annotations__):
        assert getattr(config, f.name) == f.default, f.name
    assert no_switch_on == []  # verl's own config switched nothing on


def test_a_recipe_config_switches_the_feature_on_and_defaults_do_not(no_switch_on):
    SlimCheckpointConfig.defaults()
    assert no_switch_on == []
    SlimCheckpointConfig()
    assert no_switch_on == ["checkpoint"]


@pytest.mark.parametrize(
    "given, held",
    [
        (False, "off"),
        ("false", "off"),
        ("off", "off"),
        (True, "pool"),
        ("true", "pool"),
        ("pool", "pool"),
        ("stream", "stream"),
        ("Stream", "stream"),
    ],
)
def test_async_save_is_held_as_one_of_three_words(no_switch_on, given, held):
    config = SlimCheckpointConfig(recipe="incremental", incremental_save=True, async_save=given)
    assert config.async_save == held
    assert typing.get_args(typing.get_type_hints(SlimCheckpointConfig)["async_save"]) == ("off", "pool", "stream")
    # what the config holds builds the same config again (dataclasses.replace, a copy of it)
    assert dataclasses.replace(config).async_save == held


def test_every_field_has_its_type_and_docstring_once():
    """Each of slimckpt's fields is declared once in the class body, followed by its docstring,
    and its allowed values are its type (no second table of field types)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(CheckpointOptions)))
    body = tree.body[0].body
    declared = [(i, node.target.id) for i, node in enumerate(body) if isinstance(node, ast.AnnAssign)]
    names = [name for _, name in declared]
    assert len(names) == len(set(names)) and set(names) == set(CheckpointOptions.__annotations__)
    for i, name in declared:
        doc = body[i + 1]
        assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and doc.value.value.strip(), name
    hints = typing.get_type_hints(CheckpointOptions)
    for name in ("recipe", "export_dtype", "on_save_error", "best_mode", "async_save"):
        assert typing.get_origin(hints[name]) is typing.Literal, name
    assert cc.RECIPES == typing.get_args(hints["recipe"])
    for table in ("BOOL_FIELDS", "INT_FIELDS", "FLOAT_FIELDS", "ENUM_FIELDS", "OPTIONAL_INT_FIELDS"):
        assert not hasattr(cc, table), table


def test_the_tracker_watches_the_role_dirs_verl_names():
    """save/driver/tracker names verl's role dirs without importing verl: the names must stay verl's."""
    from verl.trainer.ppo.utils import Role

    from slimckpt.save.driver.tracker import watched_roles

    config = {"_target_": "slimckpt.verl.checkpoint_config.SlimCheckpointConfig", "incremental_save": True}
    async_config = {**config, "async_save": True}
    trainer = SimpleNamespace(
        config={"actor_rollout_ref": {"actor": {"checkpoint": async_config}}, "critic": {"checkpoint": config}},
        use_critic=True,
    )
    assert watched_roles(trainer) == ["actor", str(Role.Critic)]
