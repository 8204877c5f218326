"""plan/cost: the per-rank arithmetic (shards, optimizer state, host peaks, the export's bytes, peak disk, the
stream rows), and a row built from a checkpoint config as training reads it."""

from __future__ import annotations

import pytest

from slimckpt.plan import build, cost


def test_shard_rows_follow_torch_chunk():
    import torch

    for rows in (1, 2, 7, 64, 1000, 1001):
        for world in (1, 2, 3, 8):
            got = [cost.shard_rows(rows, world, r) for r in range(world)]
            want = [c.shape[0] for c in torch.arange(rows).chunk(world)] + [0] * world
            assert got == want[:world], (rows, world)


def test_bytes_add_up_over_ranks():
    params = [cost.ParamSpec("a", (1000, 64)), cost.ParamSpec("b", (7,)), cost.ParamSpec("c", (3, 5), False)]
    full = sum(p.nbytes for p in params)
    for world in (1, 2, 3, 8):
        assert sum(cost.model_shard_bytes(params, world, r) for r in range(world)) == full
    assert cost.optim_shard_bytes(params, 1, 0) == 2 * (1000 * 64 + 7) * 4 + 2 * cost.STEP_BYTES
    assert cost.largest_shard_bytes(params, 3, 0) == 334 * 64 * 4


def test_streaming_memory_is_bounded_by_bucket_not_model():
    params = [cost.ParamSpec(f"w{i}", (4096, 4096)) for i in range(40)]  # 2.5 GiB fp32
    shard = 2048 * 4096 * 4
    default = cost.estimate(params, 2, cost.Strategy("verl"), 0, 0, None, fsdp=1)
    default2 = cost.estimate(params, 2, cost.Strategy("verl"), 0, 0, None, fsdp=2)
    inc = cost.estimate(params, 2, cost.Strategy("inc", incremental=True, bucket_mb=64), 0, 0, None)
    # FSDP1: verl offloads the whole model shard, then torch.save copies optimizer tensors one by one
    assert default.host_peak_bytes == cost.model_shard_bytes(params, 2, 0) + shard
    assert default2.host_peak_bytes == shard
    assert inc.host_peak_bytes == 64 * 2**20 + shard
    assert any("transient" in n for n in inc.notes)  # FSDP1's device-side copy is stated
    assert not cost.estimate(params, 2, cost.Strategy("inc", incremental=True), 0, 0, None, fsdp=2).notes
    staged = cost.estimate(
        params, 2, cost.Strategy("a", incremental=True, async_save=True, host_memory_budget_gb=16), 0, 0, 2.0
    )
    staged_bytes = cost.model_shard_bytes(params, 2, 0) + cost.optim_shard_bytes(params, 2, 0)
    assert staged.host_peak_bytes == staged_bytes and "staging" in staged.blocking
    over = cost.estimate(
        params, 2, cost.Strategy("a", incremental=True, async_save=True, host_memory_budget_gb=1), 0, 0, 2.0
    )
    assert over.host_peak_bytes == inc.host_peak_bytes and over.blocking == "whole save"
    assert staged.write_seconds == pytest.approx(staged.total_write_bytes / 2e9)


def test_export_bytes_follow_the_dtype_each_save_writes():
    """verl's hf_model and export_dtype=auto write the parameters' fp32; the intermediate recipe bf16."""
    bf16 = 1000
    assert cost.export_bytes(cost.Strategy("verl"), bf16, "bf16") == 0
    assert cost.export_bytes(cost.Strategy("hf", contents=("model", "hf_model")), bf16, "bf16") == 2000
    assert (
        cost.export_bytes(cost.Strategy("inc", incremental=True, export_hf=True, export_dtype="auto"), bf16, "bf16")
        == 2000
    )
    assert cost.export_bytes(cost.Strategy("mid", export_hf=True, export_dtype="bf16"), bf16, "bf16") == 1000


def test_peak_disk_for_keep_1_2_and_unset():
    per_step = 1000
    one, two, unset = cost.peak_disk(per_step, 1), cost.peak_disk(per_step, 2), cost.peak_disk(per_step, None)
    assert (one["verl_bytes"], one["slimckpt_bytes"], one["slimckpt_bytes_tracker_behind"]) == (2000, 3000, 3000)
    assert (two["verl_bytes"], two["slimckpt_bytes"], two["slimckpt_bytes_tracker_behind"]) == (2000, 3000, 4000)
    for d in (one, two):
        assert d["slimckpt_bytes"] - d["verl_bytes"] == per_step and not d["grows_without_bound"]
    assert unset["grows_without_bound"] and unset["verl_bytes"] is None and unset["slimckpt_bytes"] is None
    assert unset["per_step_bytes"] == per_step


def test_plan_stream_rows_follow_the_rollout_window():
    params = [cost.ParamSpec(f"w{i}", (4096, 4096)) for i in range(40)]
    strategy = cost.Strategy("s", incremental=True, async_save=True, async_stream=True, host_memory_budget_gb=0.5)
    est = cost.estimate(params, 2, strategy, 0, 0, 2.0, fsdp=2, rollout_s=[0.0, 1e6])
    shard = cost.model_shard_bytes(params, 2, 0) + cost.optim_shard_bytes(params, 2, 0)
    assert est.host_peak_bytes == 64 * 2**20 + 2048 * 4096 * 4  # the sync bound: no pool
    first, last = est.stream
    assert first["pending_bytes"] == shard and first["copied_bytes"] == 2**29
    assert first["wait_s"] == pytest.approx(est.write_seconds * (1 - 2**29 / shard))
    assert last["pending_bytes"] == 0 and last["wait_s"] == 0.0
    assert cost.Strategy.from_checkpoint_config("x", {"incremental_save": True, "async_save": "stream"}).async_stream
    pool = cost.Strategy.from_checkpoint_config("x", {"incremental_save": True, "async_save": "pool"})
    assert pool.async_save and not pool.async_stream


def test_plan_reads_a_checkpoint_config_as_training_does():
    """The plan's row of a config is built from CheckpointOptions, so what training refuses the plan
    refuses in the same words (keep_optimizer_last=0 was once planned as "keep every step's")."""
    from slimckpt.options.checkpoint_options import CheckpointOptions

    with pytest.raises(ValueError) as training:
        CheckpointOptions(incremental_save=True, keep_optimizer_last=0)
    with pytest.raises(ValueError) as planned:
        cost.Strategy.from_checkpoint_config("x", {"incremental_save": True, "keep_optimizer_last": 0})
    assert str(planned.value) == f"slimckpt plan: x: {training.value}"
    with pytest.raises(
        ValueError,
        match=r"^slimckpt plan: \+recipe=incremental keep_optimizer_last=0: checkpoint\.keep_optimizer_last=0",
    ):
        build.recipe_strategies(["incremental"], ["keep_optimizer_last=0"])
    kept = cost.Strategy.from_checkpoint_config(
        "x", {"incremental_save": True, "keep_optimizer_last": "2", "bucket_mb": "32"}
    )
    assert kept.keep_optimizer_last == 2 and kept.bucket_mb == 32  # YAML's spellings, taken as training takes them
    with pytest.raises(
        ValueError, match=r"^slimckpt plan: \+recipe=incremental keep_best=2: checkpoint\.keep_best needs"
    ):
        build.recipe_strategies(["incremental"], ["keep_best=2"])  # training refuses it too
    ranked = build.recipe_strategies(["incremental"], ["keep_best=2", "best_metric=critic/score/mean"])
    assert [s.keep_best for s in ranked] == [2]


def test_the_node_plan_under_offload_keeps_the_stream_window(tmp_path):
    """With verl's offload, a stream write reads the offload's host copies: a rollout window that
    outlasts the write blocks nothing and copies nothing, as without offload."""
    params = [cost.ParamSpec(f"w{i}", (4096, 4096)) for i in range(40)]
    strategy = cost.Strategy("s", incremental=True, async_save=True, async_stream=True, host_memory_budget_gb=64)
    free = cost.estimate(params, 2, strategy, 0, 0, 2.0, fsdp=2, rollout_s=[1e6], copy_gbps=5.0)
    off = cost.estimate(
        params, 2, strategy, 0, 0, 2.0, fsdp=2, rollout_s=[1e6], copy_gbps=5.0, offload=("param", "optimizer")
    )
    assert free.stream[0]["blocked_s"] == 0.0 and off.stream[0]["blocked_s"] == 0.0
    assert off.stream[0]["window_s"] == 1e6 and off.stream[0]["copied_bytes"] == 0
    assert "host copies verl's offload makes" in off.host_note
