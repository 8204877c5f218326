"""The incremental tier's gather-free HF export (slimckpt.save.export.direct plans it,
slimckpt.save.export.direct_write writes it; which rank writes which rows: tests/layout/test_export_assign.py).

Fast: the LoRA rows a writer holds, the config and verl's own hf_model. Slow: a torchrun scenario (2 ranks, gloo, FSDP2)
that saves a tiny Llama and a tiny tied Qwen2 with verl's own hf_model and with export_hf (sync and
async), and compares the exports tensor for tensor (slimckpt_testing/scenarios/hf_direct_export.py, run in the
torchrun it shares with tests/save/test_resume_state.py: conftest's ws2_scenarios).
"""

from __future__ import annotations

import pytest

from slimckpt.layout.export_assign import Box, full_box

from ..conftest import scenario_result
from ..layout.test_export_assign import rows

# --------------------------------------------------------------------------- planning and config (fast)


def _chunk_rows(n: int, world: int, width: int) -> list[Box | None]:
    """Each rank's dim-0 box as torch.chunk cuts a tensor (FSDP2's Shard(0), FSDP1's sharded state dict)."""
    import torch

    out, start = [], 0
    for part in torch.arange(n).chunk(world):
        out.append(rows(start, len(part), (n, width)))
        start += len(part)
    return out + [None] * (world - len(out))


def test_merged_lora_writers_hold_b_rows_of_their_w_rows():
    """export_merge_lora: W [out, in] and B [out, r] have the same dim 0, so FSDP's chunks put B's rows
    of a rank's W rows on that rank for every size and world size (B is sliced, not gathered); where
    a writer lacks them (B cut elsewhere, or only some of its r columns) B is all-gathered like A."""
    from slimckpt.layout.safetensors_layout import LoraDelta, Take
    from slimckpt.save.export.direct import b_rows_elsewhere

    takes: dict = {}
    for n in range(1, 12):
        takes["w.out"] = Take("w", (n, 6), None, LoraDelta("a", "b", 2.0))
        for world in range(1, 5):
            w_boxes, b_boxes = _chunk_rows(n, world, 6), _chunk_rows(n, world, 2)
            held = [{k: v for k, v in (("w", wb), ("b", bb)) if v is not None} for wb, bb in zip(w_boxes, b_boxes)]
            shares = [[("w.out", wb)] if wb is not None else [] for wb in w_boxes]
            assert b_rows_elsewhere(held, shares, takes, {"b": (n, 2)}) == frozenset(), (n, world)
    shapes = {"b": (4, 2)}
    takes["w.out"] = Take("w", (4, 6), None, LoraDelta("a", "b", 2.0))
    shares = [[("w.out", rows(0, 2, (4, 6)))], [("w.out", rows(2, 2, (4, 6)))]]
    replicated = [{"b": full_box((4, 2))}, {"b": full_box((4, 2))}]
    assert b_rows_elsewhere(replicated, shares, takes, shapes) == frozenset()
    cut_elsewhere = [{"b": rows(0, 3, (4, 2))}, {"b": rows(3, 1, (4, 2))}]
    assert b_rows_elsewhere(cut_elsewhere, shares, takes, shapes) == {"w.out"}
    column_shard = [{"b": Box((0, 0), (4, 1))}, {"b": Box((0, 1), (4, 1))}]
    assert b_rows_elsewhere(column_shard, shares, takes, shapes) == {"w.out"}


def test_config_accepts_auto_only_for_the_incremental_tier():
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    ok = SlimCheckpointConfig(
        recipe="incremental",
        incremental_save=True,
        export_hf=True,
        export_dtype="auto",
        save_contents=["model", "optimizer", "extra", "hf_model"],
    )
    assert ok.export_hf
    with pytest.raises(ValueError, match="auto"):
        SlimCheckpointConfig(recipe="intermediate", export_hf=True, export_dtype="auto", save_contents=["model"])
    with pytest.raises(ValueError, match="hf_model"):
        SlimCheckpointConfig(recipe="intermediate", save_contents=["model", "hf_model"], export_hf=True)


def test_verl_save_skips_its_hf_model_gather_only_when_the_export_replaces_it():
    from types import SimpleNamespace

    from slimckpt.save.export.direct import side_contents
    from slimckpt.save.target import SaveTarget, TargetState

    def target(export_hf: bool):
        contents = ("model", "optimizer", "extra", "hf_model")
        options = SimpleNamespace(export_hf=export_hf)
        return SaveTarget(None, None, options, TargetState(), rank=0, save_contents=contents)

    assert side_contents(target(True)) == []
    assert side_contents(target(False)) == ["hf_model"]


# --------------------------------------------------------------------------- torchrun (slow)


@pytest.mark.slow
def test_export_equals_verl_hf_model(ws2_scenarios):
    """Tiny Llama and tied Qwen2, FSDP2, 2 ranks: export_hf (sync, one file; async, several files,
    written after training moved the parameters) equals verl's hf_model tensor for tensor (names,
    dtypes, shapes, bits), config.json and generation_config.json included; the single file is
    byte-identical; it loads with from_pretrained; the manifest lists it; a bf16 export is the cast,
    byte-identical to verl's own merger's bf16 output of the same weights;
    a rank failing mid-export fails the save on every rank and leaves the step uncommitted."""
    result = scenario_result(ws2_scenarios, "hf_export", "hf_direct_export_result.json")
    for model, r in result.items():
        for mode in ("sync", "async"):
            c = r[mode]
            assert c["diffs"] == [] and c["n_ours"] == c["n_verl"] > 0, (model, mode, c)
            assert c["dtypes"] == ["torch.float32"], (model, mode)  # verl's hf_model writes the fp32 params
            assert c["same_text"] == {"config.json": True, "generation_config.json": True}, (model, mode, c)
        assert r["sync"]["bytes_identical"], model
        assert "model.safetensors.index.json" in r["async"]["files"], r["async"]["files"]
        assert not r["async_committed_before_finish"]
        assert not r["broken_committed"] and "rank 1" in r["broken_error"], r["broken_error"]
        assert r["sync_loads"] and r["async_loads"] and r["bf16_equal_cast"], model
        # incremental's default export_dtype=bf16 is what verl's own merger writes from the same weights
        m = r["bf16_vs_verl_merger"]
        assert m["diffs"] == [] and m["n_ours"] == m["n_verl"] > 0 and m["dtypes"] == ["torch.bfloat16"], (model, m)
        assert m["bytes_identical"], (model, m)
        for mode in ("sync", "async"):
            listed = r[f"manifest_{mode}"]
            weights = [f"huggingface/{n}" for n in r[mode]["files"] if n.endswith((".safetensors", ".json"))]
            assert set(weights) <= set(listed), (model, mode, listed)
    # tied embeddings: lm_head.weight is not written, as verl's drop_tied_target_keys drops it
    assert result["llama"]["sync"]["has_lm_head"] and not result["qwen2-tied"]["sync"]["has_lm_head"]


@pytest.mark.slow
def test_moe_exports_of_both_tiers_equal_verl(ws2_scenarios):
    """Qwen3-MoE and DeepSeek-V3 (MLA, shared expert, dense first layer), 3 experts over 2 ranks
    (uneven shards; and Qwen3-MoE with verl's divisible placement, which shards them on dim 1),
    FSDP2, verl's FSDPCheckpointManager: the incremental tier's gather-free export
    (each rank writes its rows of every per-expert tensor) equals verl's hf_model tensor for tensor,
    byte for byte in one file; the intermediate tier's streamed export is its bf16 cast and is
    committed by our manifest (not verl's merger); both load with from_pretrained (experts fused
    again) to what verl's export loads to. A fallback to verl's merger, forced: refused with
    allow_verl_fallback=false, or dying on rank 0, ends every rank in the same line at once."""
    result = scenario_result(ws2_scenarios, "moe_export", "moe_export_result.json")
    assert set(result) == {"qwen3-moe", "deepseek-v3", "qwen3-moe:divisible"}
    assert result["qwen3-moe"]["expert_placements"] == ["(Shard(dim=0),)"]
    assert result["qwen3-moe:divisible"]["expert_placements"] == ["(Shard(dim=1),)"]  # 3 experts, 2 ranks
    for spec, r in result.items():
        model = spec.split(":")[0]
        c = r["incremental"]
        assert c["diffs"] == [] and c["n_ours"] == c["n_verl"] > 0, (model, c)
        assert c["dtypes"] == ["torch.float32"] and len([f for f in c["files"] if f.endswith(".safetensors")]) > 1
        assert c["same_text"] == {"config.json": True, "generation_config.json": True}, (model, c)
        assert r["one_file"]["diffs"] == [] and r["one_file"]["bytes_identical"], (model, r["one_file"])
        assert r["n_experts_split"] == {"qwen3-moe": 2 * 3 * 3, "deepseek-v3": 3 * 3}[model]
        assert r["intermediate_equal_cast"] and r["intermediate_committed"], model
        for tier in ("incremental", "intermediate"):
            assert r["loads"][tier] == {"loading_info": {}, "same_as_verl_loaded": True}, (model, tier, r["loads"])
        weights = [f"huggingface/{n}" for n in c["files"] if n.endswith((".safetensors", ".json"))]
        assert set(weights) <= set(r["manifest_incremental"]), model
    r = result["qwen3-moe"]
    for case, says in (
        ("refused", "not run, as checkpoint.allow_verl_fallback=false asks"),
        (
            "verl_died",
            "verl's FSDPModelMerger (which this checkpoint needs) failed: RuntimeError: verl's merger died (simulated)",
        ),
    ):
        ranks = r[case]["ranks"]
        lines = {x["line"] for x in ranks}
        assert len(lines) == 1 and None not in lines, (case, ranks)
        line = lines.pop()
        assert "\n" not in line and says in line and "HF export of" in line, (case, line)
        assert all(x["seconds"] < 30 for x in ranks), (case, ranks)  # not the collective's 240 s timeout
        assert not r[case]["committed"] and r[case]["weights"] == [], (case, r[case])
    assert "of host memory (the " in r["refused"]["ranks"][0]["line"]


@pytest.mark.slow
def test_lora_exports_of_both_tiers_equal_verl_merger(ws2_scenarios):
    """A LoRA actor (peft, q_proj/v_proj), FSDP2 on 2 ranks, through verl's manager: the intermediate
    tier's export is every file verl's merger writes of the same step, byte for byte (the base model
    with peft's names undone, lora_adapter/ with adapter_config.json); the incremental tier's
    gather-free one has the same weights, adapter and configs (its tokenizer files are verl's save's);
    with export_merge_lora=true both tiers' exports are peft's merge_and_unload() of that output,
    bit for bit, and have no lora_adapter/."""
    r = scenario_result(ws2_scenarios, "lora_export", "lora_export_result.json")
    ref = r["reference"]
    assert {"model.safetensors", "lora_adapter/adapter_model.safetensors", "lora_adapter/adapter_config.json"} <= set(
        ref
    )
    assert r["intermediate"] == ref
    inc = r["incremental"]
    for name in (
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "lora_adapter/adapter_model.safetensors",
        "lora_adapter/adapter_config.json",
    ):
        assert inc.get(name) == ref[name], name
    merged = r["merged"]
    assert (
        not any(n.startswith("lora_adapter/") for n in merged)
        and merged["model.safetensors"] != ref["model.safetensors"]
    )
    # the incremental tier's merged export: each rank its own rows of W and B, A all-gathered; bit for bit
    # the intermediate tier's (bf16, here with async_save from the staged copy) and `slimckpt merge
    # --merge_lora` of verl's save in fp32 (export_dtype=auto: the parameters' dtype)
    assert r["incremental_merged"]["model.safetensors"] == merged["model.safetensors"]
    assert not any(n.startswith("lora_adapter/") for n in r["incremental_merged"])
    # async_save=stream: the write reads the live W, A, B; the next optimizer step's guard copies what it
    # has not read yet, so the export is the saved step's, as a sync save of the same weights writes it
    stream, now = r["incremental_merged_stream"], r["incremental_merged_now"]
    assert stream["model.safetensors"] == now["model.safetensors"] != merged["model.safetensors"]
    fp32 = r["incremental_merged_fp32"]
    assert fp32["model.safetensors"] == r["merge_lora_fp32"]["model.safetensors"] != merged["model.safetensors"]
    v = r["merged_vs_peft"]
    assert v["same_keys"] and v["max_abs_diff"] == 0.0, v
    assert v["changed"] == [f"model.layers.{i}.self_attn.{m}_proj.weight" for i in range(2) for m in ("q", "v")]
