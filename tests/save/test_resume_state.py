"""The incremental tier's resume state: commit record, retention guard, tracker, config checks
(fast), and save/load through verl's real FSDPCheckpointManager under torchrun (slow)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import slimckpt.engine.resume_records as rr
import slimckpt.layout.resume_manifest as rm
from tests.helpers.launch import scenario

from ..conftest import scenario_result

# --------------------------------------------------------------------------- manifest (pure)


def _role_dir(tmp_path: Path, step: int, role: str = "actor") -> Path:
    d = tmp_path / f"global_step_{step}" / role
    (d / "dcp").mkdir(parents=True)
    (d / "dcp" / "__0_0.distcp").write_bytes(b"x" * 100)
    (d / "dcp" / ".metadata").write_bytes(b"m" * 10)
    return d


def _commit(d: Path, step: int) -> rm.Manifest:
    files = rm.describe_files(str(d), ["dcp/__0_0.distcp", "dcp/.metadata"])
    manifest = rm.Manifest(global_step=step, world_size=1, contents=["model"], files=files)
    rr.write_manifest(str(d), manifest)
    return manifest


def test_uncommitted_dir_is_refused_with_one_line(tmp_path):
    d = _role_dir(tmp_path, 5)
    with pytest.raises(rm.UncommittedCheckpoint) as info:
        rm.read_manifest(str(d))
    msg = str(info.value)
    assert "\n" not in msg and str(d) in msg and rm.MANIFEST_NAME in msg and "resume_from_path" in msg


def test_manifest_round_trip_and_file_checks(tmp_path):
    d = _role_dir(tmp_path, 5)
    written = _commit(d, 5)
    read = rm.read_manifest(str(d))
    assert read.files == written.files and read.global_step == 5 and read.files[0].checksum is not None
    rm.check_files(str(d), read.files, checksums=True)

    # same size, different bytes: only the checksum sees it
    (d / "dcp" / "__0_0.distcp").write_bytes(b"y" * 100)
    rm.check_files(str(d), read.files, checksums=False)
    with pytest.raises(rm.UncommittedCheckpoint, match="xxh3_128"):
        rm.check_files(str(d), read.files, checksums=True)
    (d / "dcp" / "__0_0.distcp").write_bytes(b"y" * 99)
    with pytest.raises(rm.UncommittedCheckpoint, match="99 bytes"):
        rm.check_files(str(d), read.files, checksums=False)
    os.remove(d / "dcp" / "__0_0.distcp")
    with pytest.raises(rm.UncommittedCheckpoint, match="missing"):
        rm.check_files(str(d), read.files, checksums=False)


def test_remove_manifest_uncommits(tmp_path):
    d = _role_dir(tmp_path, 1)
    _commit(d, 1)
    assert rm.has_manifest(str(d))
    rr.remove_manifest(str(d))
    assert not rm.has_manifest(str(d))
    assert not [n for n in os.listdir(d) if ".tmp." in n]


def test_other_format_is_refused(tmp_path):
    d = _role_dir(tmp_path, 1)
    (d / rm.MANIFEST_NAME).write_text(json.dumps({"format": "something-else/9"}))
    with pytest.raises(rm.UncommittedCheckpoint, match="something-else/9"):
        rm.read_manifest(str(d))


def test_tracker_is_atomic_and_never_moves_back(tmp_path):
    assert rm.read_tracker(str(tmp_path)) is None
    assert rr.write_tracker(str(tmp_path), 3)
    assert not rr.write_tracker(str(tmp_path), 2)
    assert rm.read_tracker(str(tmp_path)) == 3
    # verl reads it with int(f.read().decode())
    assert int((tmp_path / rm.TRACKER_NAME).read_bytes().decode()) == 3
    assert sorted(os.listdir(tmp_path)) == [rm.TRACKER_NAME]


def test_step_of_parses_verl_layout(tmp_path):
    assert rm.step_of(str(tmp_path / "global_step_12" / "actor")) == (str(tmp_path), 12)
    assert rm.step_of(str(tmp_path / "somewhere" / "actor")) is None


def test_retention_keeps_the_newest_and_the_tracker_step(tmp_path):
    paths = [str(tmp_path / f"global_step_{s}" / "actor") for s in (1, 2, 3)]
    keep, delete = rm.split_retention(paths, 1, protect=set())
    assert keep == paths[2:] and delete == paths[:2]
    # the tracker names step 2: it survives until the tracker moves on
    rr.write_tracker(str(tmp_path), 2)
    protect = rm.protected_dirs(paths)
    assert protect == {os.path.abspath(paths[1])}
    keep, delete = rm.split_retention(paths, 1, protect)
    assert keep == paths[1:] and delete == paths[:1]
    assert rm.split_retention(paths, None, set()) == (paths, [])
    assert rm.split_retention(paths, 0, set()) == (paths, [])


# --------------------------------------------------------------------------- tracker watcher


def test_commit_watcher_moves_tracker_only_after_every_manifest(tmp_path):
    from slimckpt.save.driver.tracker import CommitWatcher

    root = str(tmp_path)
    actor = _role_dir(tmp_path, 4, "actor")
    critic = _role_dir(tmp_path, 4, "critic")
    watcher = CommitWatcher(root)
    watcher.after_save(4, ["actor", "critic"])
    _commit(actor, 4)
    (tmp_path / "global_step_4" / "data.pt").write_bytes(b"d")
    with pytest.raises(RuntimeError, match="not committed within"):
        # three of the watcher's 0.2 s polls: long enough to show it still waits, short enough to stay fast
        watcher.wait(timeout=0.6)  # the critic has no manifest yet
    assert rm.read_tracker(root) is None
    _commit(critic, 4)
    # the manifest is on disk: the watcher's next 0.2 s poll sees it; 10 s is a hang
    watcher.wait(timeout=10)
    assert rm.read_tracker(root) == 4


def test_commit_watcher_stops_on_a_failed_write(tmp_path):
    from slimckpt.save.driver.tracker import CommitWatcher

    actor = _role_dir(tmp_path, 2, "actor")
    watcher = CommitWatcher(str(tmp_path))
    watcher.after_save(2, ["actor"])
    rr.write_failure(str(actor), 1, "step 2: OSError: disk full")
    with pytest.raises(RuntimeError, match="failed"):
        # the failure marker is on disk: the watcher's next 0.2 s poll sees it; 10 s is a hang
        watcher.wait(timeout=10)
    assert rm.read_tracker(str(tmp_path)) is None


def test_commit_watcher_gives_up_a_step_retention_deleted(tmp_path):
    """Async at max_ckpt_to_keep=1: the next step's commit deleted this one before the watcher saw
    its manifest. The watcher neither hangs nor names it; the tracker stays where it was."""
    import shutil

    from slimckpt.save.driver.tracker import CommitWatcher

    _role_dir(tmp_path, 5, "actor")
    rr.write_tracker(str(tmp_path), 4)
    watcher = CommitWatcher(str(tmp_path))
    watcher.after_save(5, ["actor"])
    shutil.rmtree(tmp_path / "global_step_5")
    # the step dir is gone: the watcher's next 0.2 s poll gives it up; 10 s is a hang
    watcher.wait(timeout=10)
    assert rm.read_tracker(str(tmp_path)) == 4


@pytest.mark.parametrize("left", ["nothing", "manifest_removed"])
def test_commit_watcher_gives_up_a_step_whose_role_dir_retention_removed(tmp_path, left):
    """Retention removes the role dir (verl tracks role dirs) and leaves the step dir with
    data.pt; a delete cut short leaves the dir without its manifest. Once a newer step of that role
    is committed, the watcher gives the old step up without naming it, for any watched role."""
    import shutil

    from slimckpt.save.driver.tracker import CommitWatcher

    watcher = CommitWatcher(str(tmp_path))  # this run's saves: step 1, then 2
    for role in ("actor", "critic"):
        _role_dir(tmp_path, 1, role)
    (tmp_path / "global_step_1" / "data.pt").write_bytes(b"d")
    _commit(tmp_path / "global_step_1" / "actor", 1)
    for role in ("actor", "critic"):
        _commit(_role_dir(tmp_path, 2, role), 2)
    critic = tmp_path / "global_step_1" / "critic"
    if left == "nothing":
        shutil.rmtree(critic)
    watcher.after_save(1, ["actor", "critic"])
    # step 2 is committed: the watcher's next 0.2 s poll gives step 1 up; 10 s is a hang
    watcher.wait(timeout=10)
    assert rm.read_tracker(str(tmp_path)) is None
    assert "critic dir was deleted by retention once step 2 committed" in watcher.superseded


def test_commit_watcher_still_waits_for_an_unfinished_step_without_a_newer_commit(tmp_path):
    """A role dir without its manifest is given up only when a newer step of that role has
    committed: before that, it is a write still in flight (or a half-written step) and is never named."""
    from slimckpt.save.driver.tracker import CommitWatcher

    _role_dir(tmp_path, 3, "actor")
    (tmp_path / "global_step_3" / "data.pt").write_bytes(b"d")
    _role_dir(tmp_path, 4, "actor")  # the next step, not committed yet
    watcher = CommitWatcher(str(tmp_path))
    watcher.after_save(3, ["actor"])
    with pytest.raises(RuntimeError, match="not committed within"):
        # three of the watcher's 0.2 s polls: long enough to show it still waits, short enough to stay fast
        watcher.wait(timeout=0.6)
    assert watcher.superseded is None and rm.read_tracker(str(tmp_path)) is None
    _commit(tmp_path / "global_step_3" / "actor", 3)
    # the manifest is on disk: the watcher's next 0.2 s poll sees it; 10 s is a hang
    watcher.wait(timeout=10)
    assert rm.read_tracker(str(tmp_path)) == 3


def test_commit_watcher_names_a_step_below_a_newer_commit_left_from_before_the_run(tmp_path):
    """A resume that walked back from a damaged step 4 to step 2 saves step 3: step 4's old
    manifest is no commit of this run, so step 3 is named once it commits (not given up)."""
    from slimckpt.save.driver.tracker import CommitWatcher

    _commit(_role_dir(tmp_path, 4, "actor"), 4)
    rr.atomic_write_text(str(tmp_path / rm.TRACKER_NAME), "2")
    watcher = CommitWatcher(str(tmp_path))
    d = _role_dir(tmp_path, 3, "actor")
    (d.parent / "data.pt").write_bytes(b"d")
    watcher.after_save(3, ["actor"])
    with pytest.raises(RuntimeError, match="not committed within"):
        # three of the watcher's 0.2 s polls: long enough to show it still waits, short enough to stay fast
        watcher.wait(timeout=0.6)  # no manifest yet: still waiting, not superseded by step 4
    _commit(d, 3)
    # the manifest is on disk: the watcher's next 0.2 s poll sees it; 10 s is a hang
    watcher.wait(timeout=10)
    assert watcher.superseded is None and rm.read_tracker(str(tmp_path)) == 3


def test_watched_roles_follow_the_configs():
    from omegaconf import OmegaConf

    from slimckpt.save.driver.tracker import watched_roles

    def trainer(actor: dict, critic: dict, use_critic: bool = True):
        config = OmegaConf.create(
            {"actor_rollout_ref": {"actor": {"checkpoint": actor}}, "critic": {"checkpoint": critic}}
        )
        return type("T", (), {"config": config, "use_critic": use_critic})()

    slim = {"_target_": "slimckpt.verl.checkpoint_config.SlimCheckpointConfig", "incremental_save": True}
    verl = {"_target_": "verl.trainer.config.CheckpointConfig"}
    assert watched_roles(trainer({**slim, "async_save": False}, slim)) is None
    assert watched_roles(trainer({**slim, "async_save": True}, {**slim, "async_save": True})) == ["actor", "critic"]
    assert watched_roles(trainer({**slim, "async_save": True}, verl)) == ["actor"]
    assert watched_roles(trainer({**slim, "async_save": True}, slim, use_critic=False)) == ["actor"]
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.checkpoint.async_save=true"):
        watched_roles(trainer(verl, {**slim, "async_save": True}))


# --------------------------------------------------------------------------- config


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


# --------------------------------------------------------------------------- RNG of a reshard (pure)


def _saved_rng(k: int) -> dict:
    """A rank's RNG state as verl's get_rng_state holds it, some draws into its streams."""
    import random

    import numpy as np
    import torch

    g = torch.Generator().manual_seed(k)
    torch.rand(5, generator=g)
    npr = np.random.RandomState(k)
    npr.rand(3)
    pyr = random.Random(k)
    pyr.random()
    return {"cpu": g.get_state(), "numpy": npr.get_state(), "random": pyr.getstate()}


def _same(a, b) -> bool:
    """Exact equality of RNG states (tensors, numpy arrays, nested tuples and dicts)."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _shares_a_generator(a: dict, b: dict) -> bool:
    return any(_same(a[k], b[k]) for k in a.keys() & b.keys())


def test_derived_rng_is_deterministic_distinct_and_never_a_saved_stream():
    from slimckpt.save.rng_reshard import derive_rng_state

    saved = [_saved_rng(k) for k in range(3)]
    derived = {r: derive_rng_state(saved[r % 3], r) for r in range(3, 9)}
    for r, state in derived.items():
        assert set(state) == {"cpu", "numpy", "random"}
        assert _same(state, derive_rng_state(_saved_rng(r % 3), r)), r  # equal inputs, equal state
        assert not any(_shares_a_generator(state, s) for s in saved), r
        assert not any(_shares_a_generator(state, other) for q, other in derived.items() if q != r), r
    # the saved state matters too, not only the rank
    assert not _shares_a_generator(derive_rng_state(saved[0], 3), derive_rng_state(saved[1], 3))
    assert _same(saved[0], _saved_rng(0))  # the input is left alone


def test_derived_rng_loads_through_verl_and_skips_an_absent_device():
    import random

    import numpy as np
    import torch
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    from slimckpt.save.rng_reshard import derive_rng_state

    before = BaseCheckpointManager.get_rng_state()
    try:
        source = {**before, "cuda": torch.zeros(16, dtype=torch.uint8)}  # as a GPU run saves it
        derived = derive_rng_state(source, 5)
        assert ("cuda" in derived) == torch.cuda.is_available()
        BaseCheckpointManager.load_rng_state(derived)
        draws = (torch.rand(4), np.random.rand(4), random.random())
        BaseCheckpointManager.load_rng_state(derived)
        assert _same((torch.rand(4), np.random.rand(4), random.random()), draws)
    finally:
        BaseCheckpointManager.load_rng_state(before)


def test_reshard_message_names_derived_and_dropped_ranks():
    from slimckpt.save.rng_reshard import reshard_message

    assert reshard_message(2, 2) is None
    assert reshard_message(2, 3) == (
        "RNG resharded from world size 2 to 3: ranks 0-1 resume their saved streams "
        "exactly; rank 2 gets a new stream derived from saved rank 0 and its rank"
    )
    assert "ranks 2-7 get new streams derived, rank r from saved rank r % 2, and the rank" in reshard_message(2, 8)
    assert reshard_message(3, 2) == (
        "RNG resharded from world size 3 to 2: ranks 0-1 resume their saved streams "
        "exactly; the stream of saved rank 2 is not resumed"
    )
    assert "rank 0 resumes its saved stream exactly; the streams of saved ranks 1-3 are not resumed" in reshard_message(
        4, 1
    )


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
