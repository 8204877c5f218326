"""verl/checkpoint_config: SlimCheckpointConfig, the recipe block verl builds in the driver and every worker:
it switches the checkpoint patches on, refuses an unsupported verl, type-checks every field and names a
misspelt one in one line."""

import textwrap

import pytest

from slimckpt import SUPPORTED_VERL

from ..conftest import run_python


def test_recipe_config_switches_on_checkpoint_patches_with_a_log_line():
    res = run_python(
        textwrap.dedent("""
        import verl
        from slimckpt.verl.checkpoint_config import SlimCheckpointConfig
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager as M
        cfg = SlimCheckpointConfig(recipe="quickstart", save_contents=["model"], load_contents=["model"])
        print("MODULE", M.save_checkpoint.__code__.co_filename.rsplit("/", 1)[-1])
    """)
    )
    assert res.returncode == 0, res.stderr
    assert "MODULE checkpoint_patches.py" in res.stdout
    assert "patched verl.utils.checkpoint.fsdp_checkpoint_manager:FSDPCheckpointManager.save_checkpoint" in res.stderr


def test_recipe_config_fails_loudly_on_unsupported_verl():
    res = run_python(
        textwrap.dedent("""
        import slimckpt.verl_files.version as r
        r.installed_verl_version = lambda: "0.12.0"
        from slimckpt.verl.checkpoint_config import SlimCheckpointConfig
        SlimCheckpointConfig(recipe="quickstart")
    """)
    )
    assert res.returncode != 0
    assert "verl 0.12.0 is installed" in res.stderr and SUPPORTED_VERL in res.stderr


def test_recipe_config_rejects_unknown_recipe_and_conflicting_export():
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    with pytest.raises(ValueError, match="not a slimckpt recipe"):
        SlimCheckpointConfig(recipe="turbo")
    with pytest.raises(ValueError, match="hf_model"):
        SlimCheckpointConfig(recipe="intermediate", save_contents=["model", "hf_model"], export_hf=True)


@pytest.fixture
def no_switch_on(monkeypatch):
    """Build SlimCheckpointConfig in this process without applying the checkpoint patches."""
    from slimckpt.verl import features

    monkeypatch.setattr(features, "switch_on", lambda feature: None)


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("async_save", "streaming", "false, true (= pool), pool or stream"),
        ("async_save", 1, "false, true (= pool), pool or stream"),
        ("export_hf", "maybe", "true or false"),
        ("measure", 1, "true or false"),
        ("incremental_save", "yes", "true or false"),
        ("verify", None, "true or false"),
        ("save_lora_only", "no", "true or false"),
        ("allow_verl_fallback", "never", "true or false"),
        ("export_merge_lora", "merged", "true or false"),
        ("bucket_mb", "lots", "whole number"),
        ("bucket_mb", 64.5, "whole number"),
        ("write_threads", True, "whole number"),
        ("host_memory_budget_gb", "big", "number of GiB"),
        ("host_memory_budget_gb", float("nan"), "number of GiB"),
        ("export_dtype", "bf61", "bf16"),
        ("on_save_error", "stpo", "stop, continue"),
        ("recipe", 3, "quickstart"),
    ],
)
def test_recipe_config_type_checks_every_field_in_one_line(no_switch_on, key, value, allowed):
    """A non-empty string is true: without the check `async_save=stream` ran as true."""
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    kwargs = {"recipe": "incremental", "incremental_save": True, key: value}
    with pytest.raises(ValueError) as err:
        SlimCheckpointConfig(**kwargs)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint.{key}={value!r}") and allowed in message, message


def test_recipe_config_takes_yaml_booleans_and_numbers(no_switch_on):
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    cfg = SlimCheckpointConfig(
        recipe="incremental",
        incremental_save="true",
        async_save=True,
        export_hf="False",
        verify=False,
        bucket_mb="32",
        write_threads=2,
        host_memory_budget_gb=8,
    )
    assert (cfg.incremental_save, cfg.async_save, cfg.export_hf, cfg.verify) == (True, "pool", False, False)
    assert (cfg.bucket_mb, cfg.write_threads, cfg.host_memory_budget_gb) == (32, 2, 8.0)
    assert isinstance(cfg.host_memory_budget_gb, float)


def test_recipe_config_rejects_a_string_bool_the_way_verl_builds_it(no_switch_on):
    """verl builds a `_target_` config with Hydra's instantiate, which passes `stream` as a string:
    async_save takes it (and pool), any other string fails in one line."""
    from verl.utils.config import omega_conf_to_dataclass

    from slimckpt.verl.dryrun import compose_config

    node = "actor_rollout_ref.actor.checkpoint"
    good = compose_config(["+recipe=incremental", f"{node}.async_save=true"])
    assert omega_conf_to_dataclass(good.actor_rollout_ref.actor.checkpoint).async_save == "pool"
    for word, held in (("stream", "stream"), ("pool", "pool"), ("false", "off")):
        cfg = compose_config(["+recipe=incremental", f"{node}.async_save={word}"])
        assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.checkpoint).async_save == held, word
    bad = compose_config(["+recipe=incremental", f"{node}.async_save=streem"])
    with pytest.raises(Exception, match=r"checkpoint.async_save='streem' \(str\) is not allowed; use false, true"):
        omega_conf_to_dataclass(bad.actor_rollout_ref.actor.checkpoint)


def test_misspelled_field_names_the_field_and_the_valid_ones():
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    cfg = OmegaConf.create(
        {
            "_target_": "slimckpt.verl.checkpoint_config.SlimCheckpointConfig",
            "recipe": "incremental",
            "bukcet_mb": 3,
        }
    )
    with pytest.raises(Exception) as info:
        omega_conf_to_dataclass(cfg)
    msg = str(info.value)
    assert "'bukcet_mb'" in msg and "did you mean 'bucket_mb'" in msg and "host_memory_budget_gb" in msg


def test_async_without_incremental_is_rejected():
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    with pytest.raises(ValueError, match="incremental_save=true"):
        SlimCheckpointConfig(recipe="incremental", async_save=True)
    with pytest.raises(ValueError, match="bucket_mb"):
        SlimCheckpointConfig(recipe="incremental", incremental_save=True, bucket_mb=0)
    ok = SlimCheckpointConfig(recipe="incremental", incremental_save=True, async_save=True)
    assert ok.host_memory_budget_gb > 0
