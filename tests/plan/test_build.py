"""plan/build: `slimckpt plan`'s report for a known config checked against the parameter count worked out by
hand, its peak disk, and MoE, LoRA and vision-language configs planned as transformers and peft build them."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from slimckpt.plan import build, command, cost, meta_model, printers

from .conftest import N_TENSORS, PARAMS, TINY
from .conftest import plan_args as _args


def test_report_for_a_known_config(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    args = argparse.Namespace(
        config=str(cfg),
        world_size=2,
        recipe=["incremental", "quickstart"],
        disk_gbps=2.0,
        export_dtype="bf16",
        max_shard_size=None,
        trust_remote_code=False,
        json=True,
    )
    r = build.build_report(args)
    assert r["parameters"] == PARAMS and r["tied"] == []
    assert r["fp32_model_bytes"] == 4 * PARAMS
    assert r["rank0_model_shard_bytes"] == 4 * PARAMS // 2  # every dim 0 here is even
    assert r["rank0_optimizer_shard_bytes"] == 2 * 4 * PARAMS // 2 + cost.STEP_BYTES * N_TENSORS
    assert r["hf_export"]["files"][0]["name"] == "model.safetensors"
    assert r["hf_export"]["bytes"] > 2 * PARAMS  # bf16 data + header
    by = {e["strategy"]: e for e in r["estimates"]}
    extra = r["extra_bytes_per_rank"]
    assert by["verl default"]["total_write_bytes"] == 4 * PARAMS * 3 + 2 * (cost.STEP_BYTES * N_TENSORS + extra)
    assert by["+recipe=incremental"]["total_write_bytes"] == by["verl default"]["total_write_bytes"]
    assert by["+recipe=quickstart"]["total_write_bytes"] == 4 * PARAMS
    assert by["verl + hf_model"]["host_peak_bytes"] == by["verl default"]["host_peak_bytes"] + 4 * PARAMS
    assert by["verl default"]["host_peak_bytes"] == r["rank0_model_shard_bytes"] + r["largest_tensor_shard_bytes"]
    out = io.StringIO()
    printers.print_report(r, out)
    assert "+recipe=incremental" in out.getvalue() and "model.safetensors" in out.getvalue()


def test_verls_hf_model_export_is_timed_as_rank_0_writing_alone(tmp_path):
    """verl's hf_model export comes after the shards and only rank 0 writes it: at one node's
    share of the storage (or --writer-gbps), not at the aggregate all ranks get."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))

    def report(**kw):
        r = build.build_report(_args(cfg, world_size=32, recipe=["incremental"], disk_gbps=2.0, **kw))
        return r, {e["strategy"]: e for e in r["estimates"]}

    r, by = report(gpus_per_node=8)
    verl, ours = by["verl + hf_model"], by["+recipe=incremental"]
    assert verl["export_by_rank0"] and not ours["export_by_rank0"] and not by["verl default"]["export_by_rank0"]
    shards = verl["total_write_bytes"] / 2e9
    assert r["writer"] == {"gbps": 0.5, "source": "--disk-gbps over 4 nodes"}
    assert verl["write_seconds"] == pytest.approx(shards + verl["hf_export_bytes"] / 0.5e9)
    assert ours["write_seconds"] == pytest.approx((ours["total_write_bytes"] + ours["hf_export_bytes"]) / 2e9)
    assert by["verl default"]["write_seconds"] == pytest.approx(shards)
    out = io.StringIO()
    printers.print_report(r, out)
    assert "verl + hf_model: the export is written by rank 0 alone after the shards, at 0.5 GB/s" in out.getvalue()

    r, by = report(gpus_per_node=8, writer_gbps=0.25)
    assert r["writer"]["source"] == "--writer-gbps"
    assert by["verl + hf_model"]["write_seconds"] == pytest.approx(shards + verl["hf_export_bytes"] / 0.25e9)
    r, by = report(gpus_per_node=32)  # one node: the lone writer is not held below the storage's speed
    assert by["verl + hf_model"]["write_seconds"] == pytest.approx(shards + verl["hf_export_bytes"] / 2e9)
    with pytest.raises(ValueError, match="^slimckpt plan: --writer-gbps 0: give a bandwidth above 0 GB/s$"):
        report(writer_gbps=0.0)


# --------------------------------------------------------------------------- peak disk


def test_report_peak_disk(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    # unset: each row keeps what its config does (verl's null; every recipe 2, incremental's optimizer in 1)
    r = build.build_report(_args(cfg, critic=True))
    by = {e["strategy"]: e["peak_disk"] for e in r["estimates"]}
    assert by["verl default"]["actor"]["grows_without_bound"]
    inc = by["+recipe=incremental"]
    for role in ("actor", "critic"):
        assert not inc[role]["grows_without_bound"] and inc[role]["max_ckpt_to_keep"] == 2, inc[role]
    quick = by["+recipe=quickstart"]
    assert quick["actor"]["max_ckpt_to_keep"] == 2 and quick["critic"]["max_ckpt_to_keep"] == 2
    assert quick["actor"]["per_step_bytes"] == 4 * PARAMS  # fp32 model shards
    # the critic: lm_head (1000 x 64) swapped for a one-output value head, no HF export
    assert quick["critic"]["per_step_bytes"] == 4 * (PARAMS - 1000 * 64 + 64)
    out = io.StringIO()
    printers.print_report(r, out)
    assert "grows without bound" in out.getvalue() and "critic" in out.getvalue()

    # given: every row at the same keep, option and --set alike; per step = resume state + HF export
    for kw in ({"max_actor_ckpt_to_keep": "1"}, {"overrides": ["trainer.max_actor_ckpt_to_keep=1"]}):
        r = build.build_report(_args(cfg, **kw))
        for e in r["estimates"]:
            d = e["peak_disk"]["actor"]
            assert d["per_step_bytes"] == e["total_write_bytes"] + e["hf_export_bytes"]
            assert (d["verl_steps"], d["slimckpt_steps"]) == (2, 3)
            assert d["slimckpt_bytes"] - d["verl_bytes"] == d["per_step_bytes"]
            assert "critic" not in e["peak_disk"]
    r = build.build_report(_args(cfg, max_actor_ckpt_to_keep="none"))
    assert all(e["peak_disk"]["actor"]["grows_without_bound"] for e in r["estimates"])
    # the JSON output carries it
    assert command.run(_args(cfg, max_actor_ckpt_to_keep="2")) == 0
    printed = json.loads(capsys.readouterr().out)
    assert {e["peak_disk"]["actor"]["slimckpt_steps"] for e in printed["estimates"]} == {3}


def qwen3_30b_a3b_config(path):
    """A Qwen3-30B-A3B-shaped config (128 experts of 768, 8 per token, 48 layers, hidden 2048)."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
        bos_token_id=151643,
        eos_token_id=151645,
    ).save_pretrained(path)
    return path / "config.json"


def test_an_moe_config_is_planned(tmp_path):
    """Fused experts ([128, 1536, 2048] and [128, 2048, 768] per layer) are what FSDP shards; the HF
    export holds them split per expert, as save_pretrained writes them."""
    cfg = qwen3_30b_a3b_config(tmp_path)
    r = build.build_report(_args(cfg, world_size=16))
    V, H, L, E, inter = 151936, 2048, 48, 128, 768
    per_layer = H * 4096 + 2 * H * 512 + 4096 * H + 2 * 128 + 2 * H + E * H + E * 2 * inter * H + E * H * inter
    params = 2 * V * H + L * per_layer + H
    assert r["parameters"] == params and 30.4e9 < params < 30.6e9
    assert r["fp32_model_bytes"] == 4 * params
    assert r["largest_tensor_shard_bytes"] == E * 2 * inter * H * 4 // 16  # gate_up_proj: 8 experts on each rank
    assert r["fp32_model_bytes"] // 16 <= r["rank0_model_shard_bytes"] < r["fp32_model_bytes"] // 16 + 2**20
    assert r["split_on_save"] == {"fused_tensors": 2 * L, "outputs": 3 * E * L}
    assert 2 * params < r["hf_export"]["bytes"] < 2 * params + 8 * 2**20  # bf16 + headers of 18.9k tensors
    by = {e["strategy"]: e for e in r["estimates"]}
    assert by["verl + hf_model"]["host_peak_bytes"] == by["verl default"]["host_peak_bytes"] + 4 * params
    assert any("split on save" in n for n in by["+recipe=incremental"]["notes"])
    buf = io.StringIO()
    printers.print_report(r, buf)
    out = buf.getvalue()
    assert command.run(_args(cfg, world_size=16)) == 0  # the command: --json here
    assert "30,532,122,624 parameters" in out and "96 tensors, split into 18432 per-expert tensors" in out


# ------------------------------------------------------------------------------------------------
# LoRA and vision-language configs
# ------------------------------------------------------------------------------------------------
def _save_config(tmp_path, model: str):
    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import build_config, parse_args

    build_config(
        parse_args(["--out", "x", "--model", model, "--experts", "3", "--hidden", "64", "--vocab", "256"])
    ).save_pretrained(tmp_path)
    return tmp_path / "config.json"


@pytest.mark.parametrize(
    "model,targets",
    [
        ("llama", "all-linear"),
        ("qwen3-moe", "all-linear"),
        ("qwen3-moe", "q_proj,v_proj"),
        ("qwen2.5-vl", "q_proj,v_proj"),
    ],
)
def test_a_lora_config_is_planned_as_peft_builds_the_actor(tmp_path, model, targets):
    """The adapter's parameters are peft's on the real model (names and shapes; with all-linear on an
    MoE model peft 0.21 also adapts the fused experts and the router); the base is frozen, so AdamW
    state is the adapter's alone; the export adds lora_adapter/ in the export dtype."""
    import torch
    from peft import LoraConfig, get_peft_model

    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import auto_class, build_config, parse_args

    cfg = _save_config(tmp_path, model)
    r = build.build_report(
        _args(cfg, world_size=3, lora_rank=8, lora_alpha=16, lora_target_modules=targets, lora_exclude_modules="")
    )
    torch.manual_seed(0)
    real = auto_class(model).from_config(
        build_config(parse_args(["--out", "x", "--model", model, "--experts", "3", "--hidden", "64", "--vocab", "256"]))
    )
    base_params = sum(p.numel() for p in real.parameters())
    peft_targets = "all-linear" if targets == "all-linear" else targets.split(",")
    peft = get_peft_model(real, LoraConfig(r=8, lora_alpha=16, target_modules=peft_targets, task_type="CAUSAL_LM"))
    adapter = {
        n.removeprefix("base_model.model."): tuple(p.shape) for n, p in peft.named_parameters() if p.requires_grad
    }
    facts = meta_model.model_facts(str(cfg), lora=build.lora_spec(_args(cfg, lora_rank=8, lora_target_modules=targets)))
    assert {p.name: p.shape for p in facts.params if p.trainable} == adapter
    lora = r["lora"]
    assert lora["parameters"] == sum(a * b for a, b in adapter.values()) and lora["rank"] == 8
    assert r["parameters"] == base_params + lora["parameters"]
    trainable = [p for p in facts.params if p.trainable]
    assert r["rank0_optimizer_shard_bytes"] == cost.optim_shard_bytes(trainable, 3, 0)
    assert r["rank0_model_shard_bytes"] == cost.model_shard_bytes(facts.params, 3, 0)
    files = {f["name"]: f["bytes"] for f in r["hf_export"]["files"]}
    assert 2 * lora["parameters"] < files["lora_adapter/adapter_model.safetensors"] == lora["adapter_bytes"]
    assert r["hf_export"]["bytes"] == sum(files.values())
    buf = io.StringIO()
    printers.print_report(r, buf)
    assert f"LoRA rank 8 (alpha 16) on {lora['modules']} modules (target_modules={targets}" in buf.getvalue()
    if model == "qwen3-moe" and targets == "all-linear":
        assert any(".experts." in n for n in adapter)  # LoRA on the fused experts: planned too


def test_a_vision_language_config_is_planned(tmp_path):
    """Qwen2.5-VL: every parameter of the language model and the vision tower, and the HF export
    exactly as save_pretrained writes it (names, sizes: the file's bytes)."""
    import torch
    from safetensors import safe_open

    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import auto_class, build_config, parse_args

    cfg = _save_config(tmp_path / "cfg", "qwen2.5-vl")
    r = build.build_report(_args(cfg, world_size=3))
    model = auto_class("qwen2.5-vl").from_config(
        build_config(parse_args(["--out", "x", "--model", "qwen2.5-vl", "--hidden", "64", "--vocab", "256"])),
        dtype=torch.bfloat16,
    )
    assert r["parameters"] == sum(p.numel() for p in model.parameters())
    assert r["vision_parameters"] == sum(p.numel() for p in model.model.visual.parameters()) > 0
    model.save_pretrained(tmp_path / "saved")
    saved = tmp_path / "saved" / "model.safetensors"
    assert r["hf_export"]["files"] == [{"name": "model.safetensors", "bytes": saved.stat().st_size}]
    with safe_open(str(saved), "pt") as f:
        assert any(k.startswith("visual.") for k in f.keys())  # the original layout, as save_pretrained writes it
    buf = io.StringIO()
    printers.print_report(r, buf)
    assert f"vision tower: {r['vision_parameters']:,} parameters" in buf.getvalue()
