"""Mixture-of-experts checkpoints: transformers 5 stores an MoE layer's experts fused
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and splits them per
expert on save. `slimckpt merge` plans each split as the run of the fused tensor's elements it is
(`HfSide.output_sources`, `layout.Take`) and streams it; here for Qwen3-MoE, Mixtral, OLMoE,
Qwen2-MoE (shared expert) and DeepSeek-V3 (MLA, shared experts, a dense first layer).

Fast tests: what `output_sources` learns from meta tensors is what the conversion makes of real
tensors, and the writers cut spans right from every kind of source. Slow ones (one torchrun saves
all five families through verl's FSDPCheckpointManager, FSDP2 on gloo, 3 experts over 2 ranks so
the shards are uneven): the merge equals verl's merger byte for byte and loads with
from_pretrained, alone, with --distributed_merge and through `python -m verl.model_merger`."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import slimckpt.layout.safetensors_layout as layout
from slimckpt.hf.naming import HfSide, NeedsVerlMerger
from slimckpt.layout.merge_manifest import MANIFEST_NAME, verify
from slimckpt.merge.pipeline import merge
from slimckpt.merge.plan import MergeOptions
from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import MOE_MODELS, build_config, parse_args

from ..helpers.merge_helpers import (
    SHAKE,
    assert_same_tensors,
    assert_same_tree,
    dir_tensors,
    fsdp_checkpoint,
    full_state_from_shards,
    run,
    torchrun,
    verl_merge,
)

FIXTURE_ARGS = ["--experts", "3", "--steps", "0", "--layers", "2", "--hidden", "64", "--vocab", "256"]


def family_config(family: str):
    return build_config(parse_args(["--out", "unused", "--model", family, *FIXTURE_ARGS]))


def hf_side_of(tmp_path, config, dtype: str = "fp32") -> HfSide:
    config.save_pretrained(tmp_path / "huggingface")
    return HfSide(str(tmp_path), dtype, False)


# ------------------------------------------------------------------------------------------------
# fast: what output_sources learns, and the writers
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", MOE_MODELS)
def test_output_sources_are_what_the_conversion_makes_of_index_tensors(tmp_path, family):
    """Learnt on meta tensors; checked by running the same conversion on tensors whose values are
    their own element indices: every output is exactly elements [span) of its source."""
    from transformers.core_model_loading import revert_weight_conversion

    side = hf_side_of(tmp_path, family_config(family))
    shapes = {n: tuple(t.shape) for n, t in side.model.state_dict().items()}
    takes = side.output_sources(list(shapes), shapes)
    index = {n: torch.arange(torch.Size(s).numel(), dtype=torch.float64).reshape(s) for n, s in shapes.items()}
    real = revert_weight_conversion(side.model, dict(index))
    assert list(real) == list(takes)
    for new, t in real.items():
        take = takes[new]
        flat = index[take.source].reshape(-1)
        assert tuple(t.shape) == take.shape, new
        assert torch.equal(t.reshape(-1), flat if take.whole else flat[take.span[0] : take.span[1]]), new
    split = [t for t in takes.values() if not t.whole]
    assert len(split) == 3 * 3 * (1 if family == "deepseek-v3" else 2)  # gate, up, down of 3 experts per MoE layer
    # every element of a fused tensor lands in exactly one output
    for source in {t.source for t in split}:
        spans = sorted(t.span for t in split if t.source == source)
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert spans[-1][1] == torch.Size(shapes[source]).numel()
    # a caller that writes whole tensors only is told so
    with pytest.raises(NeedsVerlMerger, match="converts tensors"):
        side.output_names(list(shapes), shapes)


def test_a_strided_or_composite_conversion_is_refused_in_one_line(tmp_path, monkeypatch):
    """An output that is not one run of one checkpoint tensor (a transpose, a concatenation) is not
    streamed: NeedsVerlMerger says which tensor."""
    import transformers.core_model_loading as cml

    side = hf_side_of(tmp_path, family_config("mixtral"))
    shapes = {n: tuple(t.shape) for n, t in side.model.state_dict().items()}
    fused = "model.layers.0.mlp.experts.down_proj"
    monkeypatch.setattr(cml, "revert_weight_conversion", lambda model, sd: {"t": sd[fused].transpose(1, 2)})
    with pytest.raises(NeedsVerlMerger, match=f"'t' is a strided part of '{fused}'"):
        side.output_sources(list(shapes), shapes)
    monkeypatch.setattr(cml, "revert_weight_conversion", lambda model, sd: {"c": torch.cat([sd[fused], sd[fused]])})
    with pytest.raises(NeedsVerlMerger, match="'c' is not a part of one checkpoint tensor"):
        side.output_sources(list(shapes), shapes)


def _source(name, full: torch.Tensor, shard_dim, pieces):
    from slimckpt.engine.verl_sources import SourceTensor

    return SourceTensor(name, tuple(full.shape), full.dtype, shard_dim, pieces, list(range(len(pieces))))


@pytest.mark.parametrize("kind", ["dim0", "dim0-strided", "dim1", "plain-1", "plain-2"])
def test_the_torch_writer_cuts_spans_from_every_kind_of_source(tmp_path, kind):
    """Spans of a [3, 6, 5] fused tensor (the halves of each expert, and a whole expert) from dim-0
    shards (contiguous: flat chunks; strided: from rows), dim-1 shards, and unsharded copies, in
    7-byte chunks: the bytes of the spans cut from the whole tensor."""
    from safetensors.torch import load_file

    from slimckpt.engine.out_files import create_files
    from slimckpt.engine.share_writer import ShareWriter

    full = torch.randn(3, 6, 5, generator=torch.Generator().manual_seed(0))
    pieces = {
        "dim0": (0, [full[:2].clone(), full[2:].clone()]),
        "dim0-strided": (0, [full.transpose(1, 2).contiguous().transpose(1, 2)[:2], full[2:].clone()]),
        "dim1": (1, [full[:, :4].contiguous(), full[:, 4:].contiguous()]),
        "plain-1": (None, [full.clone()]),
        "plain-2": (None, [full.clone(), full.clone()]),
    }[kind]
    src = _source("fused", full, *pieces)
    takes = {
        f"e{e}.{half}": layout.Take("fused", (3, 5), (e * 30 + h * 15, e * 30 + h * 15 + 15))
        for e in range(3)
        for h, half in enumerate(("gate", "up"))
    }
    takes["e1.whole"] = layout.Take("fused", (6, 5), (30, 60))
    specs = [layout.TensorSpec(n, "BF16", t.shape) for n, t in takes.items()]
    plan = layout.plan_files(specs, "5GB")
    create_files(str(tmp_path), plan)
    for share in layout.partition(plan, 3):  # three writers' shares, cut at rows of the outputs
        ShareWriter(
            str(tmp_path), plan, {n: src for n in takes}, torch.bfloat16, chunk_bytes=7, takes=takes
        ).write_share(share)
    out = load_file(str(tmp_path / "model.safetensors"))
    flat = full.reshape(-1).to(torch.bfloat16)
    for name, take in takes.items():
        assert torch.equal(out[name].reshape(-1), flat[take.span[0] : take.span[1]]), name


def test_the_torch_writer_compares_unsharded_copies_of_a_split_tensor(tmp_path):
    from slimckpt.engine.out_files import create_files
    from slimckpt.engine.share_writer import ShareWriter
    from slimckpt.engine.verl_sources import CheckpointError

    full = torch.randn(2, 4, 3)
    other = full.clone()
    other[1, 3, 2] += 1
    src = _source("fused", full, None, [full, other])
    takes = {"e1": layout.Take("fused", (4, 3), (12, 24))}
    plan = layout.plan_files([layout.TensorSpec("e1", "BF16", (4, 3))], "5GB")
    create_files(str(tmp_path), plan)
    with pytest.raises(CheckpointError, match="'fused' differs from rank 0's copy"):
        ShareWriter(str(tmp_path), plan, {"e1": src}, torch.bfloat16, takes=takes).write_share(
            layout.partition(plan, 1)[0]
        )


# ------------------------------------------------------------------------------------------------
# slow: real verl checkpoints of the five families, saved in one torchrun
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return fsdp_checkpoint(tmp_path_factory, "moe_families", 2, "--models", ",".join(MOE_MODELS), *FIXTURE_ARGS)


def ours(local_dir, target, **kw):
    return merge(MergeOptions(local_dir=str(local_dir), target_dir=str(target), progress=False, **kw))


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_MODELS)
def test_same_as_verl_merger_and_loads(families, tmp_path, family):
    from transformers import AutoModelForCausalLM

    ckpt = families / family
    assert verl_merge(ckpt, tmp_path / "verl") is None
    result = ours(ckpt, tmp_path / "ours", chunk_bytes=1000)  # experts cross chunks
    assert not result.used_verl_merger and result.tokenizer_saved
    assert_same_tensors(dir_tensors(tmp_path / "ours"), dir_tensors(tmp_path / "verl"))
    verl_files = sorted(os.listdir(tmp_path / "verl"))
    assert sorted(set(os.listdir(tmp_path / "ours")) - {MANIFEST_NAME}) == verl_files
    for f in verl_files:  # one file: every byte as verl writes it
        assert (tmp_path / "ours" / f).read_bytes() == (tmp_path / "verl" / f).read_bytes(), f
    assert verify(str(tmp_path / "ours")) == []
    # from_pretrained fuses the experts again: the shards' weights, in bf16, nothing missing or left over
    model, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype=torch.bfloat16, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    loaded = model.state_dict()
    source = full_state_from_shards(ckpt)
    assert any(t.dim() == 3 for t in source.values())  # fused experts in the shards
    for name, t in source.items():
        assert torch.equal(loaded[name], t.to(torch.bfloat16)), name


@pytest.mark.slow
def test_distributed_merge_and_verl_redirect(families, tmp_path):
    """--distributed_merge over 2 torchrun ranks x 2 workers, files split small so shares cut experts:
    the single-process merge's bytes. `python -m verl.model_merger merge` reaches the same merge."""
    ckpt = families / "deepseek-v3"
    ours(ckpt, tmp_path / "one", max_shard_size="30KB", chunk_bytes=4096)
    reference = tmp_path / "one"
    assert len([n for n in os.listdir(reference) if n.endswith(".safetensors")]) > 2
    proc = torchrun(
        2,
        [
            "-m",
            "slimckpt.cli",
            "merge",
            "--distributed_merge",
            "--workers",
            "2",
            "--no_progress",
            "--max_shard_size",
            "30KB",
            "--chunk_mb",
            "1",
            "--local_dir",
            str(ckpt),
            "--target_dir",
            str(tmp_path / "d"),
        ],
        env=SHAKE,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 rank(s) x 2 worker(s)" in proc.stderr and "verl's own FSDPModelMerger" not in proc.stderr
    assert_same_tree(tmp_path / "d", reference)

    ckpt = families / "qwen3-moe"
    proc = run(
        [
            sys.executable,
            "-m",
            "verl.model_merger",
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            str(ckpt),
            "--target_dir",
            str(tmp_path / "redirected"),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "slimckpt merge committed" in proc.stderr and "verl's own FSDPModelMerger" not in proc.stderr
    assert json.loads((tmp_path / "redirected" / MANIFEST_NAME).read_text())["tool"] == "slimckpt"
    assert verl_merge(ckpt, tmp_path / "verl") is None
    assert_same_tensors(dir_tensors(tmp_path / "redirected"), dir_tensors(tmp_path / "verl"))


def test_fixture_models_are_the_families_claimed():
    """The fixture's configs build what the module docstring says (checked without torchrun)."""
    names = {f: type(family_config(f)).__name__ for f in MOE_MODELS}
    assert names == {
        "qwen3-moe": "Qwen3MoeConfig",
        "mixtral": "MixtralConfig",
        "olmoe": "OlmoeConfig",
        "qwen2-moe": "Qwen2MoeConfig",
        "deepseek-v3": "DeepseekV3Config",
    }
    ds = family_config("deepseek-v3")
    assert ds.q_lora_rank and ds.kv_lora_rank and ds.n_shared_experts == 1 and ds.first_k_dense_replace == 1
    assert family_config("qwen2-moe").shared_expert_intermediate_size > 0


@pytest.mark.slow
def test_a_config_with_other_experts_ends_every_rank_in_one_line(families, tmp_path):
    """config.json of another expert count, merged by 2 torchrun ranks: rank 0's planning error is
    every rank's one line (naming the fused tensor, the rank file and the config), nothing committed."""
    import shutil

    ckpt = shutil.copytree(families / "deepseek-v3", tmp_path / "actor")
    config = json.loads((ckpt / "huggingface" / "config.json").read_text())
    (ckpt / "huggingface" / "config.json").write_text(json.dumps({**config, "n_routed_experts": 4}))
    proc = torchrun(
        2,
        [
            "-m",
            "slimckpt.cli",
            "merge",
            "--distributed_merge",
            "--no_progress",
            "--local_dir",
            str(ckpt),
            "--target_dir",
            str(tmp_path / "o"),
        ],
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("slimckpt merge: error:")]
    assert len(lines) == 2 and lines[0] == lines[1], proc.stderr[-3000:]
    assert "model_world_size_2_rank_0.pt: 'model.layers.1.mlp.experts.down_proj' is [3, " in lines[0]
    assert "config.json makes it [4, " in lines[0]
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


@pytest.mark.slow
def test_a_fused_tensor_of_other_sizes_than_the_config_ends_in_one_line(families, tmp_path):
    """config.json with another expert width (moe_intermediate_size): the first fused tensor whose shape
    the config does not give ends the merge in one line naming it, its rank file and the config; no
    target and no .partial are left."""
    import shutil

    from slimckpt.merge.plan import MergeError

    ckpt = shutil.copytree(families / "qwen3-moe", tmp_path / "actor")
    config = json.loads((ckpt / "huggingface" / "config.json").read_text())
    (ckpt / "huggingface" / "config.json").write_text(
        json.dumps({**config, "moe_intermediate_size": 2 * config["moe_intermediate_size"]})
    )
    with pytest.raises(MergeError) as exc:
        ours(ckpt, tmp_path / "o")
    line = str(exc.value)
    assert "\n" not in line and "model_world_size_2_rank_0.pt: 'model.layers.0.mlp.experts." in line, line
    assert "config.json makes it [3, " in line and "does not belong to this checkpoint" in line, line
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
