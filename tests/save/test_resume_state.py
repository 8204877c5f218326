"""The incremental tier's resume state saved and loaded through verl's real FSDPCheckpointManager under torchrun
(slow). Its parts alone: tests/layout/test_resume_manifest.py (the commit record, the retention guard, the
tracker file), tests/save/test_tracker.py (the commit watcher), tests/save/test_rng_reshard.py,
tests/verl/test_checkpoint_config.py (the config's checks). The modules the saves and loads here run:
verl/save_target, save/state_dicts, save/optim_capture, save/extra_state, save/export/intermediate (the
intermediate tier's export of a lora-only save)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import slimckpt.layout.resume_manifest as rm
from tests.helpers.launch import scenario

from ..conftest import scenario_result
from .conftest import same_rng_state as _same
from .conftest import shares_a_generator as _shares_a_generator

# --------------------------------------------------------------------------- torchrun (slow)
# The 2-rank scenarios run in one torchrun shared with tests/save/test_export_direct.py (conftest's
# ws2_scenarios, slimckpt_testing/scenarios/batch.py), each in its own directory with the settings it had as a
# torchrun of its own; the 1-rank reshard needs a torchrun of its own.


# a 1-rank torchrun: ~10 s of torch and verl start-up, then seconds of work; 240 s is a hang
def _torchrun(nproc: int, *args: str, timeout: int = 240, log_level: str = "WARNING") -> subprocess.CompletedProcess:
    return scenario(nproc, "slimckpt_testing.scenarios.resume", *args, timeout=timeout, log_level=log_level)


@pytest.mark.slow
def test_resume_is_bitwise_and_reshards_to_one_rank(ws2_scenarios):
    """Save at step 3 through verl's FSDPCheckpointManager (2 ranks, sync), continue; a fresh model
    that loads step 3 trains to bitwise-equal losses; the same state loads at world size 1 equal
    tensor for tensor (model, Adam moments, step, scheduler). verl's own format still round-trips."""
    r = scenario_result(ws2_scenarios, "resume", "resume_result.json")
    assert r["reference"] == r["resumed"], r
    assert r["verl_reference"] == r["verl_resumed"]
    assert r["aliases"] == {}
    assert rm.MANIFEST_NAME in r["files"] and "fsdp_config.json" in r["files"] and "huggingface" in r["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(r["dcp_files"])
    assert "model_world_size_2_rank_0.pt" in r["verl_format_files"]

    resumed_dir = ws2_scenarios / "resume"
    _torchrun(1, "reshard", "--dir", str(resumed_dir))
    w = json.loads((resumed_dir / "reshard_ws1_result.json").read_text())
    assert w["diffs"] == [] and w["n_model"] > 0, w
    _check_resharded_rng(resumed_dir, saved_world=2, world=1)  # saved rank 1's stream is dropped


def _check_resharded_rng(ckpt_root: Path, saved_world: int, world: int) -> None:
    """After a load at `world` of a step saved at `saved_world` (the reshard scenario's dumps):
    ranks the saved run had hold exactly their saved RNG state; the others a state derived as
    rng_reshard does, shared with no saved rank and no other rank; both loads gave the same."""
    import torch

    from slimckpt.save.extra_state import EXTRA_NAME
    from slimckpt.save.rng_reshard import derive_rng_state

    role = ckpt_root / "global_step_3" / "actor"
    saved = [
        torch.load(role / EXTRA_NAME.format(world=saved_world, rank=r), weights_only=False)["rng"]
        for r in range(saved_world)
    ]
    loaded = []
    for rank in range(world):
        first, second = torch.load(ckpt_root / f"rng_after_load_ws{world}_rank{rank}.pt", weights_only=False)
        assert _same(first, second), f"rank {rank}: two loads gave two RNG states"
        loaded.append(first)
    for rank, state in enumerate(loaded):
        if rank < saved_world:
            assert _same(state, saved[rank]), f"rank {rank} did not resume its saved RNG state"
            continue
        assert _same(state, derive_rng_state(saved[rank % saved_world], rank)), rank
        assert not any(_shares_a_generator(state, s) for s in saved), f"rank {rank} repeats a saved stream"
        assert not any(_shares_a_generator(state, o) for q, o in enumerate(loaded) if q != rank), rank


@pytest.mark.slow
def test_reshard_to_more_then_fewer_ranks_keeps_or_derives_rng(ws2_scenarios, tmp_path):
    """2 -> 3 -> 2 ranks through verl's FSDPCheckpointManager: the world-size-2 step loads at 3
    (uneven shards) and, after two steps, is saved at 3 and loaded at 2. Model, Adam state and
    scheduler are exact both ways; RNG as _check_resharded_rng says (the new rank 2 derived at 3,
    saved rank 2's stream dropped at 2)."""
    resumed_dir = ws2_scenarios / "resume"
    # 3 ranks on 2 cores start slower than the default's 1 (~40 s on a loaded host); 300 s is a hang
    proc = _torchrun(3, "reshard", "--dir", str(resumed_dir), "--save-to", str(tmp_path), timeout=300, log_level="INFO")
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "RNG resharded" in ln]
    assert len(lines) == 2 and all("rank 2 gets a new stream derived from saved rank 0" in ln for ln in lines), lines
    w3 = json.loads((resumed_dir / "reshard_ws3_result.json").read_text())
    assert w3["diffs"] == [] and w3["n_model"] > 0, w3
    _check_resharded_rng(resumed_dir, saved_world=2, world=3)

    # the world-size-3 step (uneven shards) merges to the state it saved
    import torch

    from slimckpt import cli

    from ..helpers.merge_helpers import assert_same_tensors, dir_tensors

    merged = tmp_path / "merged_ws3"
    assert (
        cli.main(
            [
                "merge",
                "--no_progress",
                "--dtype",
                "fp32",
                "--local_dir",
                str(tmp_path / "global_step_3" / "actor"),
                "--target_dir",
                str(merged),
            ]
        )
        == 0
    )
    assert_same_tensors(
        dir_tensors(merged), torch.load(tmp_path / "full_state_at_save.pt", weights_only=False)["model"]
    )

    _torchrun(2, "reshard", "--dir", str(tmp_path))
    w2 = json.loads((tmp_path / "reshard_ws2_result.json").read_text())
    assert w2["diffs"] == [] and w2["n_model"] > 0, w2
    _check_resharded_rng(tmp_path, saved_world=3, world=2)


@pytest.mark.slow
def test_fsdp1_resume_is_bitwise(ws2_scenarios):
    """verl's default strategy (FSDP1, FullyShardedDataParallel with a device mesh): the same
    exact-resume check at world size 2."""
    r = scenario_result(ws2_scenarios, "resume_fsdp1", "resume_result.json")
    assert r["reference"] == r["resumed"], r
    assert rm.MANIFEST_NAME in r["files"]


@pytest.mark.slow
def test_async_save_stages_and_resumes_bitwise(ws2_scenarios):
    """async_save (tied-embedding model): the save returns after staging; the write is held back
    until training has changed every parameter; the committed step still resumes to bitwise-equal
    losses."""
    r = scenario_result(ws2_scenarios, "resume_async", "resume_async_result.json")
    assert r["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}  # the tied tensor written once
    assert not r["committed_during_training"], "the held-back write should still be running"
    assert r["over_budget_committed_on_return"] is True  # over host_memory_budget_gb: streamed synchronously
    assert r["blocking_s"] < 1.5, r["blocking_s"]
    assert r["reference"] == r["resumed"], r


@pytest.mark.slow
def test_async_tracker_never_names_an_uncommitted_step(ws2_scenarios):
    r = scenario_result(ws2_scenarios, "tracker", "tracker_result.json")
    assert r["violations"] == [] and r["seen"], r
    assert r["tracker_right_after_save"][0] is None  # step 1 was still being written
    assert r["final"] == 3  # the last step is committed before the trainer returns
    # max_ckpt_to_keep=1, but the step the tracker named at the last commit is kept
    assert r["actor_dirs"] == ["global_step_2", "global_step_3"], r


@pytest.mark.slow
def test_half_written_or_damaged_step_refuses_to_load(ws2_scenarios):
    r = scenario_result(ws2_scenarios, "refuse", "refuse_result.json")
    assert r["save"] == "crashed" and "dcp" in r["half_files"] and rm.MANIFEST_NAME not in r["half_files"]
    assert r["half"].startswith("slimckpt:") and "never finished" in r["half"] and "\n" not in r["half"]
    assert "__1_0.distcp" in r["truncated"] and "damaged" in r["truncated"]


@pytest.mark.slow
def test_save_lora_only_resumes_as_a_whole_save_does(ws2_scenarios):
    """verl's save_lora_only in the incremental tier (async, with the export): the committed step holds
    the LoRA parameters and their optimizer state only; a model built on the base of model.path that
    loads it holds the same model and optimizer state as one that loads a whole save of the same step,
    and both train the run's own losses. Its export is lora_adapter/ alone (the whole save's adapter,
    byte for byte), verify passes, retention counts it; export_merge_lora is refused in one line."""
    r = scenario_result(ws2_scenarios, "lora_only", "lora_only_result.json")
    assert r["state_differs"] == [], r["state_differs"]
    assert r["after_lora"] == r["after_full"] == r["reference"], r
    lora_keys = [k for k in r["model_keys"] if "lora_A" in k or "lora_B" in k]
    assert r["model_keys"] == lora_keys and len(lora_keys) == 8  # q_proj, v_proj x 2 layers x (A, B)
    assert r["optim_state_keys"] == [k.removeprefix("model.") for k in lora_keys]
    assert r["manifest_extra"]["lora_only"] is True and r["bytes"]["lora_only"] < r["bytes"]["full"] / 2
    assert "lora_adapter/adapter_model.safetensors" in r["export_files"]
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in r["export_files"])
    assert r["adapter_same_as_full_export"] and r["adapter_config_same"] and r["verify_ok"]
    assert r["steps_kept"] == ["global_step_4"]
    assert "\n" not in r["refused"] and "with save_lora_only=true: the step holds no base weights" in r["refused"]


@pytest.mark.slow
def test_intermediate_tier_exports_the_adapter_of_a_lora_only_save(ws2_scenarios):
    """+recipe=intermediate with save_lora_only: verl writes LoRA-only .pt shards, and the export is
    lora_adapter/ alone (the incremental tier's bytes), committed by its manifest; with
    export_merge_lora the save fails in one line saying there is no base to merge into."""
    r = scenario_result(ws2_scenarios, "lora_only", "lora_only_result.json")
    files = r["intermediate_export_files"]
    assert {"lora_adapter/adapter_model.safetensors", "lora_adapter/adapter_config.json", "manifest.json"} <= set(files)
    assert not any(f.startswith("model") for f in files) and r["intermediate_adapter_same"], files
    line = r["refused_intermediate"]
    assert "\n" not in line and "holds LoRA weights only" in line and "export_merge_lora=false" in line, line


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["presave", "presave_fsdp1"])
def test_a_save_before_the_first_step_changes_nothing(ws2_scenarios, scenario):
    """An actor saved before its first update (PPO's critic_warmup), +recipe=incremental as shipped
    (export on), sync, pool and stream, FSDP2 and FSDP1: the optimizer keeps no state, no step
    count and no grad, the parameters and lr are untouched, the run and a resume from that step
    train to verl's losses bit for bit (verl saves and resumes the same step), and the step
    verifies and merges."""
    r = scenario_result(ws2_scenarios, scenario, "presave_result.json")
    verl = r.pop("verl")
    assert verl["before"]["state_entries"] == 0 and verl["after"] == verl["before"]
    assert verl["losses"] == verl["resumed"], verl
    for mode, m in r.items():
        assert m["export_hf"], mode
        assert m["before"] == verl["before"], mode
        assert m["after"] == m["before"], (mode, m["after"]["state_entries"], m["after"]["steps"], m["after"]["grads"])
        assert m["loaded"]["state_entries"] == 0 and m["loaded"]["grads"] == 0, (mode, m["loaded"])
        assert m["loaded"]["lr"] == verl["loaded"]["lr"], mode
        assert m["losses"] == verl["losses"], (mode, m["losses"], verl["losses"])
        assert m["resumed"] == verl["losses"], (mode, m["resumed"], verl["losses"])
        assert m["verify_ok"], (mode, m["verify_bad"])
        assert "model.safetensors" in m["merged"] or any(f.endswith(".safetensors") for f in m["merged"]), m["merged"]
