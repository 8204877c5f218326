"""The GPU's peak at an incremental save on FSDP1 (slimckpt.save.device_budget) and the start-up
check built on it (slimckpt.verl.fsdp1_note)."""

from __future__ import annotations

import pytest

from slimckpt.save.device_budget import ADAM, BF16, FP32, RESERVE_SHARE, RoleOnGpu, gpu_peak

GIB = 2**30
P = 1_000_000_000  # parameters of one rank's shard
UNIT = 100_000_000


def test_no_offload_holds_training_state_and_the_whole_copy():
    actor = RoleOnGpu("actor", P, copies_on_save=True, unit_elements=UNIT)
    assert actor.between_steps() == (FP32 + FP32 + ADAM) * P  # params, grads, AdamW
    assert actor.save_adds() == (FP32 + ADAM) * P + ADAM * UNIT  # the copy + one gathered unit
    peak = gpu_peak([actor], 80 * GIB)
    assert peak.need == actor.between_steps() + actor.save_adds() + int(RESERVE_SHARE * 80 * GIB)
    assert peak.fits == (peak.need <= 80 * GIB) and peak.host_copy == 0


def test_offload_moves_what_verl_moves():
    # verl loads an offloaded model back to the GPU for a save: the model's copy stays there;
    # optimizer_offload keeps AdamW (and its copy) on the host
    role = RoleOnGpu("actor", P, param_offload=True, optimizer_offload=True, copies_on_save=True, unit_elements=UNIT)
    assert role.between_steps() == 0
    assert role.save_adds() == FP32 * P + FP32 * P + FP32 * UNIT
    assert role.host_copy() == ADAM * P


def test_roles_add_their_state_and_the_largest_save_counts():
    actor = RoleOnGpu("actor", P, copies_on_save=True, unit_elements=UNIT)
    critic = RoleOnGpu("critic", P, param_offload=True, optimizer_offload=True, copies_on_save=True)
    peak = gpu_peak([actor, critic], 200 * GIB, ref_elements=P, ref_offload=False)
    assert peak.parts == {"actor": actor.between_steps(), "critic": 0, "ref": BF16 * P}
    assert peak.saving == "actor" and peak.save == actor.save_adds()
    assert peak.host_copy_role == "critic" and peak.host_copy == ADAM * P
    # FSDP2 (no copy): nothing added at the save
    assert gpu_peak([RoleOnGpu("actor", P)], 80 * GIB).save == 0


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
