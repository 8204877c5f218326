"""plan/node: the node's memory under verl's offload, the auto budget resolved against what is left, and
the verdicts."""

from __future__ import annotations

import argparse
import io
import json

from slimckpt.plan import build, cost, printers

from .conftest import N_TENSORS, TINY


def _node_args(cfg, **kw) -> argparse.Namespace:
    base = dict(
        config=str(cfg),
        world_size=16,
        recipe=["incremental"],
        disk_gbps=2.0,
        export_dtype="bf16",
        max_shard_size=None,
        trust_remote_code=False,
        json=True,
        gpus_per_node=8,
        node_memory_gb=1.0,
        copy_gbps=5.0,
        rollout_s="1e6",
    )
    return argparse.Namespace(**{**base, **kw})


def test_node_counts_verl_offload_and_resolves_auto_against_what_is_left(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    args = _node_args(
        cfg,
        param_offload=True,
        optimizer_offload=True,
        critic=True,
        overrides=["host_memory_budget_gb=auto", "async_save=true"],
    )
    r = build.build_report(args)
    node = r["node"]
    model_r, optim_r = r["rank0_model_shard_bytes"], r["rank0_optimizer_shard_bytes"]
    held = node["resident"]
    assert held["actor params (fp32)"] == model_r
    # AdamW's two fp32 moments of the rank's elements (its per-tensor step is not offloaded state)
    assert held["actor AdamW state"] == optim_r - cost.STEP_BYTES * N_TENSORS
    assert "critic params (fp32)" in held and "ref params (bf16)" not in held
    est = next(e for e in r["estimates"] if e["strategy"].startswith("+recipe=incremental"))
    want = (2**30 - 8 * node["resident_bytes"]) // 2 // 8  # half of what 8 ranks leave of 1 GiB
    assert abs(est["budget_bytes"] - want) <= 1
    row = next(v for v in r["node_rows"] if v["strategy"] == est["strategy"])
    # the actor's and the critic's staging pools are both held for the run
    assert est["host_note"].startswith("staging pool") and est["critic_host_peak_bytes"] > 0
    assert row["per_rank_bytes"] == node["resident_bytes"] + est["host_peak_bytes"] + est["critic_host_peak_bytes"]
    assert row["per_node_bytes"] == 8 * row["per_rank_bytes"]
    # an explicit number wins over auto
    fixed = build.build_report(_node_args(cfg, overrides=["host_memory_budget_gb=0.00001", "async_save=true"]))
    est = next(e for e in fixed["estimates"] if e["strategy"].startswith("+recipe=incremental"))
    assert est["budget_bytes"] == int(0.00001 * 2**30) and est["pool_over_budget"]
    row = next(v for v in fixed["node_rows"] if v["strategy"] == est["strategy"])
    assert not row["fits"] and any("runs synchronously" in p for p in row["problems"])


def test_node_verdicts_name_what_to_change(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    # a node too small for its ranks' share of verl's hf_model gather (rank 0 alone holds the full model)
    r = build.build_report(_node_args(cfg, node_memory_gb=1e-5, recipe=["quickstart"]))
    rows = {v["strategy"]: v for v in r["node_rows"]}
    by = {e["strategy"]: e for e in r["estimates"]}
    hf = rows["verl + hf_model"]
    full = r["fp32_model_bytes"]
    assert hf["per_node_bytes"] == 8 * (by["verl + hf_model"]["host_peak_bytes"] - full) + full
    assert not hf["fits"] and "over the node's" in hf["problems"][0]
    # FSDP1's incremental save adds its shards on the accelerator; FSDP2's nothing
    one = build.build_report(_node_args(cfg, fsdp=1, node_memory_gb=64))
    two = build.build_report(_node_args(cfg, fsdp=2, node_memory_gb=64))
    inc1 = next(v for v in one["node_rows"] if v["strategy"].startswith("+recipe=incremental"))
    inc2 = next(v for v in two["node_rows"] if v["strategy"].startswith("+recipe=incremental"))
    assert inc1["device_bytes"] == one["rank0_model_shard_bytes"] + one["rank0_optimizer_shard_bytes"]
    assert any("strategy=fsdp2" in p for p in inc1["problems"]) and inc2["device_bytes"] == 0 and inc2["fits"]
    assert all(v["device_bytes"] == 0 for v in one["node_rows"] if not v["strategy"].startswith("+recipe=incremental"))
    out = io.StringIO()
    printers.print_report(one, out)
    assert "device added / rank" in out.getvalue() and "per node: 8 ranks" in out.getvalue()
