"""slimckpt plan: the per-rank arithmetic, and a report for a known config checked against the
parameter count worked out by hand."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from slimckpt import plan

# a 2-layer Llama: vocab 1000, hidden 64, intermediate 128, 4 heads, 2 kv heads (head_dim 16)
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": False}
PER_LAYER = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64  # q, k+v, o, mlp, 2 norms
PARAMS = 1000 * 64 + 2 * PER_LAYER + 64 + 1000 * 64  # embed, layers, final norm, lm_head
N_TENSORS = 1 + 2 * 9 + 1 + 1


def test_shard_rows_follow_torch_chunk():
    import torch

    for rows in (1, 2, 7, 64, 1000, 1001):
        for world in (1, 2, 3, 8):
            got = [plan.shard_rows(rows, world, r) for r in range(world)]
            want = [c.shape[0] for c in torch.arange(rows).chunk(world)] + [0] * world
            assert got == want[:world], (rows, world)


def test_bytes_add_up_over_ranks():
    params = [plan.ParamSpec("a", (1000, 64)), plan.ParamSpec("b", (7,)), plan.ParamSpec("c", (3, 5), False)]
    full = sum(p.nbytes for p in params)
    for world in (1, 2, 3, 8):
        assert sum(plan.model_shard_bytes(params, world, r) for r in range(world)) == full
    assert plan.optim_shard_bytes(params, 1, 0) == 2 * (1000 * 64 + 7) * 4 + 2 * plan.STEP_BYTES
    assert plan.largest_shard_bytes(params, 3, 0) == 334 * 64 * 4


def test_streaming_memory_is_bounded_by_bucket_not_model():
    params = [plan.ParamSpec(f"w{i}", (4096, 4096)) for i in range(40)]  # 2.5 GiB fp32
    shard = 2048 * 4096 * 4
    default = plan.estimate(params, 2, plan.Strategy("verl"), 0, 0, None, fsdp=1)
    default2 = plan.estimate(params, 2, plan.Strategy("verl"), 0, 0, None, fsdp=2)
    inc = plan.estimate(params, 2, plan.Strategy("inc", incremental=True, bucket_mb=64), 0, 0, None)
    # FSDP1: verl offloads the whole model shard, then torch.save copies optimizer tensors one by one
    assert default.host_peak_bytes == plan.model_shard_bytes(params, 2, 0) + shard
    assert default2.host_peak_bytes == shard
    assert inc.host_peak_bytes == 64 * 2**20 + shard
    assert any("transient" in n for n in inc.notes)  # FSDP1's device-side copy is stated
    assert not plan.estimate(params, 2, plan.Strategy("inc", incremental=True), 0, 0, None, fsdp=2).notes
    staged = plan.estimate(params, 2, plan.Strategy("a", incremental=True, async_save=True,
                                                    host_memory_budget_gb=16), 0, 0, 2.0)
    staged_bytes = plan.model_shard_bytes(params, 2, 0) + plan.optim_shard_bytes(params, 2, 0)
    assert staged.host_peak_bytes == staged_bytes and "staging" in staged.blocking
    over = plan.estimate(params, 2, plan.Strategy("a", incremental=True, async_save=True,
                                                  host_memory_budget_gb=1), 0, 0, 2.0)
    assert over.host_peak_bytes == inc.host_peak_bytes and over.blocking == "whole save"
    assert staged.write_seconds == pytest.approx(staged.total_write_bytes / 2e9)


def test_report_for_a_known_config(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    args = argparse.Namespace(config=str(cfg), world_size=2, recipe=["incremental", "quickstart"], disk_gbps=2.0,
                              export_dtype="bf16", max_shard_size=None, trust_remote_code=False, json=True)
    r = plan.build_report(args)
    assert r["parameters"] == PARAMS and r["tied"] == []
    assert r["fp32_model_bytes"] == 4 * PARAMS
    assert r["rank0_model_shard_bytes"] == 4 * PARAMS // 2  # every dim 0 here is even
    assert r["rank0_optimizer_shard_bytes"] == 2 * 4 * PARAMS // 2 + plan.STEP_BYTES * N_TENSORS
    assert r["hf_export"]["files"][0]["name"] == "model.safetensors"
    assert r["hf_export"]["bytes"] > 2 * PARAMS  # bf16 data + header
    by = {e["strategy"]: e for e in r["estimates"]}
    extra = r["extra_bytes_per_rank"]
    assert by["verl default"]["total_write_bytes"] == 4 * PARAMS * 3 + 2 * (plan.STEP_BYTES * N_TENSORS + extra)
    assert by["+recipe=incremental"]["total_write_bytes"] == by["verl default"]["total_write_bytes"]
    assert by["+recipe=quickstart"]["total_write_bytes"] == 4 * PARAMS
    assert by["verl + hf_model"]["host_peak_bytes"] == by["verl default"]["host_peak_bytes"] + 4 * PARAMS
    assert by["verl default"]["host_peak_bytes"] == r["rank0_model_shard_bytes"] + r["largest_tensor_shard_bytes"]
    out = io.StringIO()
    plan.print_report(r, out)
    assert "+recipe=incremental" in out.getvalue() and "model.safetensors" in out.getvalue()


def test_tied_embeddings_are_counted_once(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**TINY, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                               "tie_word_embeddings": True}))
    facts = plan.model_facts(str(cfg))
    assert facts.tied == ["lm_head.weight"]
    assert sum(p.nbytes for p in facts.params) == 4 * facts.total_parameters


def test_export_bytes_follow_the_dtype_each_save_writes():
    """verl's hf_model and export_dtype=auto write the parameters' fp32; the intermediate recipe bf16."""
    bf16 = 1000
    assert plan.export_bytes(plan.Strategy("verl"), bf16, "bf16") == 0
    assert plan.export_bytes(plan.Strategy("hf", contents=("model", "hf_model")), bf16, "bf16") == 2000
    assert plan.export_bytes(plan.Strategy("inc", incremental=True, export_hf=True, export_dtype="auto"),
                             bf16, "bf16") == 2000
    assert plan.export_bytes(plan.Strategy("mid", export_hf=True, export_dtype="bf16"), bf16, "bf16") == 1000
