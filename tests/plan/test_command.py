"""plan/command: `slimckpt plan`'s run, and what it cannot plan refused in one line."""

from __future__ import annotations

import json

import pytest

from slimckpt.plan import command

from .conftest import TINY
from .conftest import plan_args as _args


@pytest.mark.parametrize(
    "kw,key",
    [
        ({"max_actor_ckpt_to_keep": "two"}, "trainer.max_actor_ckpt_to_keep"),
        ({"overrides": ["trainer.max_critic_ckpt_to_keep=x"]}, "trainer.max_critic_ckpt_to_keep"),
        ({"overrides": ["trainer.save_freq=3"]}, "trainer.save_freq"),
    ],
)
def test_bad_retention_value_is_one_line_naming_the_key(tmp_path, capsys, kw, key):
    assert command.run(_args(tmp_path / "never-read.json", **kw)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err


@pytest.mark.parametrize(
    "content,says",
    [
        ({"model_type": "no_such_model", "architectures": ["NoSuchForCausalLM"]}, "no_such_model"),
        ({**TINY, "architectures": []}, "architectures"),
        ("{not json", "cannot plan"),
    ],
)
def test_a_config_that_cannot_be_planned_ends_in_one_line(tmp_path, capsys, content, says):
    cfg = tmp_path / "config.json"
    cfg.write_text(content if isinstance(content, str) else json.dumps(content))
    assert command.run(_args(cfg, world_size=8)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "WARNING" not in line]
    assert len(err) == 1 and err[0].startswith("slimckpt plan:") and says in err[0], err


def test_a_conversion_that_is_not_a_slice_ends_in_one_line(tmp_path, capsys, monkeypatch):
    from slimckpt.hf.naming import HfSide, NeedsVerlMerger

    def refuse(self, names, shapes):
        raise NeedsVerlMerger("transformers converts tensors of X on save (e.g. 'w' is a strided part of 'v')")

    monkeypatch.setattr(HfSide, "output_sources", refuse)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    assert command.run(_args(cfg, world_size=8)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "WARNING" not in line]
    assert len(err) == 1 and "NeedsVerlMerger" in err[0] and "strided part" in err[0]


@pytest.mark.parametrize(
    "kw,says",
    [
        ({"lora_rank": -4}, "--lora-rank -4"),
        ({"lora_rank": 8, "lora_target_modules": "no_such_proj"}, "target_modules=no_such_proj"),
    ],
)
def test_a_lora_config_it_cannot_plan_ends_in_one_line(tmp_path, capsys, kw, says):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    assert command.run(_args(cfg, **kw)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "WARNING" not in line]
    assert len(err) == 1 and err[0].startswith("slimckpt plan:") and says in err[0], err
