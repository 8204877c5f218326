"""slimckpt plan: the per-rank arithmetic, and a report for a known config checked against the
parameter count worked out by hand."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from slimckpt.plan import build, command, cost, meta_model, printers

# a 2-layer Llama: vocab 1000, hidden 64, intermediate 128, 4 heads, 2 kv heads (head_dim 16)
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
PER_LAYER = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64  # q, k+v, o, mlp, 2 norms
PARAMS = 1000 * 64 + 2 * PER_LAYER + 64 + 1000 * 64  # embed, layers, final norm, lm_head
N_TENSORS = 1 + 2 * 9 + 1 + 1


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


def test_tied_embeddings_are_counted_once(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps({**TINY, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True})
    )
    facts = meta_model.model_facts(str(cfg))
    assert facts.tied == ["lm_head.weight"]
    assert sum(p.nbytes for p in facts.params) == 4 * facts.total_parameters


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


# --------------------------------------------------------------------------- peak disk


class _Manager:
    """verl's BaseCheckpointManager retention state: its list of saved role dirs."""

    def __init__(self) -> None:
        self.previous_saved_paths: list[str] = []

    def remove_previous_save_local_path(self, path):
        from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

        BaseCheckpointManager.remove_previous_save_local_path(self, path)


def _verl_method(name: str):
    """verl's own method, unpatched (the registry may have patched the class in this process)."""
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    fn = getattr(BaseCheckpointManager, name)
    return getattr(fn, "__wrapped__", fn)


def _simulate_peak(root, keep, order, saves=6, tracker_stuck_at=()):
    """Role dirs on disk at the peak over `saves` saves, in the trainer's order: the actor's save
    (retention inside it), then the tracker. `tracker_stuck_at`: steps whose tracker write is skipped
    (a failed critic with on_save_error=continue)."""
    import slimckpt.verl.checkpoint_patches as verl_retention
    from slimckpt.layout.resume_manifest import TRACKER_NAME

    m, peak = _Manager(), 0
    for step in range(1, saves + 1):
        if order == "verl":
            _verl_method("ensure_checkpoint_capacity")(m, keep)
        else:
            verl_retention.before_save(m, keep)
        role = root / f"global_step_{step}" / "actor"
        role.mkdir(parents=True)
        (role / "model_world_size_1_rank_0.pt").write_bytes(b"x")
        peak = max(peak, len(list(root.glob("global_step_*/actor"))))
        if order == "verl":
            _verl_method("register_checkpoint")(m, str(role), keep)
        else:
            verl_retention.after_save(m, str(role), keep)
        if step not in tracker_stuck_at:
            (root / TRACKER_NAME).write_text(str(step))
    return peak


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_peak_steps_match_what_retention_leaves_on_disk(tmp_path, keep):
    import slimckpt.save.retention.prune as retention

    (tmp_path / "v").mkdir(), (tmp_path / "s").mkdir()
    verl_peak = _simulate_peak(tmp_path / "v", keep, "verl")
    slim_peak = _simulate_peak(tmp_path / "s", keep, "slimckpt")
    assert verl_peak == retention.verl_peak_steps(keep) == max(keep, 2)
    assert slim_peak == retention.peak_steps(keep)[0] == verl_peak + 1  # the safe order costs one step


def test_peak_steps_with_the_tracker_behind(tmp_path):
    import slimckpt.save.retention.prune as retention

    assert _simulate_peak(tmp_path, 2, "slimckpt", tracker_stuck_at={3}) == retention.peak_steps(2)[1] == 4
    assert retention.peak_steps(1) == (3, 3)
    assert retention.peak_steps(None) is None and retention.verl_peak_steps(None) is None
    assert retention.peak_steps(0) is None  # verl: 0 and below keep everything


def test_peak_disk_for_keep_1_2_and_unset():
    per_step = 1000
    one, two, unset = cost.peak_disk(per_step, 1), cost.peak_disk(per_step, 2), cost.peak_disk(per_step, None)
    assert (one["verl_bytes"], one["slimckpt_bytes"], one["slimckpt_bytes_tracker_behind"]) == (2000, 3000, 3000)
    assert (two["verl_bytes"], two["slimckpt_bytes"], two["slimckpt_bytes_tracker_behind"]) == (2000, 3000, 4000)
    for d in (one, two):
        assert d["slimckpt_bytes"] - d["verl_bytes"] == per_step and not d["grows_without_bound"]
    assert unset["grows_without_bound"] and unset["verl_bytes"] is None and unset["slimckpt_bytes"] is None
    assert unset["per_step_bytes"] == per_step


def _args(cfg, **kw):
    base = dict(
        config=str(cfg),
        world_size=2,
        recipe=["incremental", "quickstart"],
        disk_gbps=None,
        export_dtype="bf16",
        max_shard_size=None,
        trust_remote_code=False,
        json=True,
        overrides=[],
        max_actor_ckpt_to_keep=None,
        max_critic_ckpt_to_keep=None,
        critic=False,
    )
    return argparse.Namespace(**{**base, **kw})


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


@pytest.mark.parametrize(
    "kw,key",
    [
        ({"max_actor_ckpt_to_keep": "two"}, "trainer.max_actor_ckpt_to_keep"),
        ({"overrides": ["trainer.max_critic_ckpt_to_keep=x"]}, "trainer.max_critic_ckpt_to_keep"),
        ({"overrides": ["trainer.save_freq=3"]}, "trainer.save_freq"),
    ],
)
def test_bad_retention_value_is_one_line_naming_the_key(tmp_path, capsys, kw, key):
    assert command.run(_args(tmp_path / "never-read.json", **kw)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err


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


@pytest.mark.parametrize(
    "content,says",
    [
        ({"model_type": "no_such_model", "architectures": ["NoSuchForCausalLM"]}, "no_such_model"),
        ({**TINY, "architectures": []}, "architectures"),
        ("{not json", "cannot plan"),
    ],
)
def test_a_config_that_cannot_be_planned_ends_in_one_line(tmp_path, capsys, content, says):
    cfg = tmp_path / "config.json"
    cfg.write_text(content if isinstance(content, str) else json.dumps(content))
    assert command.run(_args(cfg, world_size=8)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "WARNING" not in line]
    assert len(err) == 1 and err[0].startswith("slimckpt plan:") and says in err[0], err


def test_a_conversion_that_is_not_a_slice_ends_in_one_line(tmp_path, capsys, monkeypatch):
    from slimckpt.hf.naming import HfSide, NeedsVerlMerger

    def refuse(self, names, shapes):
        raise NeedsVerlMerger("transformers converts tensors of X on save (e.g. 'w' is a strided part of 'v')")

    monkeypatch.setattr(HfSide, "output_sources", refuse)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    assert command.run(_args(cfg, world_size=8)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "WARNING" not in line]
    assert len(err) == 1 and "NeedsVerlMerger" in err[0] and "strided part" in err[0]


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


@pytest.mark.parametrize(
    "kw,says",
    [
        ({"lora_rank": -4}, "--lora-rank -4"),
        ({"lora_rank": 8, "lora_target_modules": "no_such_proj"}, "target_modules=no_such_proj"),
    ],
)
def test_a_lora_config_it_cannot_plan_ends_in_one_line(tmp_path, capsys, kw, says):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    assert command.run(_args(cfg, **kw)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "WARNING" not in line]
    assert len(err) == 1 and err[0].startswith("slimckpt plan:") and says in err[0], err


def test_stream_model_blocks_only_when_the_step_comes_before_the_write_ends():
    from slimckpt.plan.stream import stream_block, windows_for

    gib = 2**30
    # 10 GiB written in 100 s; the next step 100 s or later after the save: nothing to do
    assert stream_block(10 * gib, 100.0, 100.0, 4 * gib).pending_bytes == 0
    assert stream_block(10 * gib, 100.0, 250.0, 0, copy_gbps=5).blocked_s == 0.0
    # at 60 s, 4 GiB unread: all fit the budget: copied, no wait
    fit = stream_block(10 * gib, 100.0, 60.0, 4 * gib, copy_gbps=2)
    assert fit.pending_bytes == 4 * gib and fit.copied_bytes == 4 * gib and fit.wait_s == 0.0
    assert fit.blocked_s == pytest.approx(4 * gib / 2e9)
    # at 0 s with a 2 GiB budget: copy 2 GiB, wait for the writer to release the other 8 (80 s)
    over = stream_block(10 * gib, 100.0, 0.0, 2 * gib)
    assert over.copied_bytes == 2 * gib and over.wait_s == pytest.approx(80.0) and over.blocked_s is None
    # budget 0: waits for the rest of the write
    assert stream_block(10 * gib, 100.0, 30.0, 0).wait_s == pytest.approx(70.0)
    assert windows_for(100.0, None) == [0.0, 25.0, 50.0, 100.0, 200.0] and windows_for(1.0, [9.0, 3.0]) == [3.0, 9.0]


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


# --------------------------------------------------------------------------- the node: offload, auto budget, verdicts


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


def test_resume_check_and_convert_are_timed_for_incremental_rows(tmp_path):
    from slimckpt.plan.resume_time import HASH_GBPS, resume_times

    t = resume_times(800 * 10**9, 32, 10.0, 2.5)
    assert t["check_spread_s"] == pytest.approx(80.0)  # read once at the aggregate bandwidth
    assert t["check_one_host_s"] == pytest.approx(320.0)  # what one host reading it all would take
    assert t["convert_s"] == pytest.approx(640.0)  # read + write on one host
    # a fast store: the ranks' hashing bounds it, each its share
    assert resume_times(800 * 10**9, 2, 1000.0, 500.0)["check_spread_s"] == pytest.approx(400 / HASH_GBPS)
    assert resume_times(10, 1, None, None)["check_spread_s"] is None

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    r = build.build_report(_args(cfg, disk_gbps=10.0))
    rows = {e["strategy"]: e.get("resume_times") for e in r["estimates"]}
    assert rows["verl default"] is None and rows["+recipe=incremental"]["resume_bytes"] > 0
    out = io.StringIO()
    printers.print_report(r, out)
    assert "slimckpt convert --to verl" in out.getvalue() and "check at resume" in out.getvalue()
