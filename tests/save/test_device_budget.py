"""The GPU's peak at an incremental save on FSDP1 (slimckpt.save.device_budget); the start-up check built on
it: tests/verl/test_fsdp1_note.py."""

from __future__ import annotations

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
