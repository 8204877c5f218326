"""verl/fsdp1_note: the start-up check built on the GPU's peak at an incremental save on FSDP1
(save/device_budget): a run whose save does not fit stops in one line, the override starts it anyway."""

from __future__ import annotations

import pytest

from ..save.test_device_budget import GIB


def _config(*overrides: str):
    from slimckpt.verl.dryrun import compose_config

    return compose_config(
        [
            "+size=70b",
            "+cluster=4x8",
            "+algo=ppo",
            "+recipe=incremental",
            "actor_rollout_ref.actor.strategy=fsdp",
            "critic.strategy=fsdp",
            *overrides,
        ]
    )


QWEN72 = (72_706_203_648, 878_000_000)  # Qwen2-72B: parameters, one decoder layer


@pytest.fixture(scope="module")
def no_offload():
    off = [
        f"{k}={v}"
        for k in ("actor_rollout_ref.actor.fsdp_config", "critic.fsdp")
        for v in ("false",)
        for k in (f"{k}.param_offload", f"{k}.optimizer_offload")
    ]
    return _config(*off)


def test_start_up_stops_a_run_whose_save_does_not_fit(no_offload, monkeypatch):
    from slimckpt.verl import fsdp1_note

    line, stop = fsdp1_note.fsdp1_check(no_offload, True, True, gpu=(80 * GIB, "given"), shape=lambda *a: QWEN72)
    assert stop and "\n" not in line
    assert line.startswith("slimckpt: an incremental save on FSDP1 does not fit the GPU")
    assert "actor_rollout_ref.actor.strategy=fsdp2" in line
    assert "actor_rollout_ref.actor.checkpoint.allow_fsdp1_device_copy=true" in line
    # in verl's driver: SystemExit with that line, before Ray starts
    monkeypatch.setenv("SLIMCKPT_GPU_MEMORY_GB", "80")
    monkeypatch.setattr(fsdp1_note, "model_shape", lambda *a: QWEN72)
    with pytest.raises(SystemExit) as info:
        fsdp1_note.say_fsdp1_cost(no_offload, True, True)
    assert str(info.value.code) == line.replace("(given)", "(SLIMCKPT_GPU_MEMORY_GB=80)")


def test_the_override_starts_it_anyway_and_a_big_gpu_fits(no_offload):
    from omegaconf import OmegaConf, open_dict

    from slimckpt.verl import fsdp1_note

    cfg = no_offload.copy()
    with open_dict(cfg):
        for role in ("actor_rollout_ref.actor", "critic"):
            OmegaConf.update(cfg, f"{role}.checkpoint.allow_fsdp1_device_copy", True)
    line, stop = fsdp1_note.fsdp1_check(cfg, True, True, gpu=(80 * GIB, "given"), shape=lambda *a: QWEN72)
    assert not stop and "does NOT fit, started anyway" in line
    line, stop = fsdp1_note.fsdp1_check(no_offload, True, True, gpu=(141 * GIB, "given"), shape=lambda *a: QWEN72)
    assert not stop and ": fits, " in line and "to spare" in line


def test_without_a_known_gpu_the_line_says_how_to_check(no_offload):
    from slimckpt.verl import fsdp1_note

    line, stop = fsdp1_note.fsdp1_check(
        no_offload, True, True, gpu=(None, "no GPU visible to the driver"), shape=lambda *a: QWEN72
    )
    assert not stop and "set SLIMCKPT_GPU_MEMORY_GB=<GiB per GPU>" in line
    # FSDP2: nothing to say
    assert fsdp1_note.fsdp1_check(
        _config("actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2"),
        True,
        True,
        gpu=(80 * GIB, "given"),
        shape=lambda *a: QWEN72,
    ) == ("", False)
