"""verl's merger bugs as a regression set: checkpoints of the kinds users reported verl 0.9.1's merger
wrong on, saved by verl's own FSDPCheckpointManager, merged by verl's merger (unpatched) and by
slimckpt's merge, each output compared exactly with the unsharded model the checkpoint was saved from
(its `save_pretrained`: the names, the dropped tied key and the per-expert split a Hugging Face save
makes; bf16 as verl writes, and slimckpt's fp32 too, where no rounding hides a wrong value).

slimckpt must be right on every case, by its streaming merge (a fallback to verl's merger would inherit verl's
bugs; verl_files/in_process_merger runs it). Where verl is wrong the test holds verl's output exactly as it
is, so it fails once verl changes; docs/merge.md has the table.

The checkpoints: one fake-process-group interpreter writes Gemma4 (persistent `layer_scalar` buffers,
tied embeddings) with its norms left unsharded at world size 64, rank by rank, and again with the
tied embedding unsharded too (its key sorts first) at world size 4; one torchrun of 2 ranks writes
the rest (vocab 255, experts 3, intermediate 129: shards of unequal size).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slimckpt.merge.pipeline import merge
from slimckpt.merge.plan import MergeOptions

from ..helpers.merge_helpers import adapter_config_fields, dir_tensors, fsdp_checkpoint, run, verl_merge

pytestmark = pytest.mark.slow

WORLD = 2
TORCHRUN_ARGS = [
    "--models",
    "qwen2-tied,llama,qwen2,qwen3-moe,llama+lora",
    "--shard-placement",
    "divisible:qwen2",  # verl's get_shard_placement_fn: the first dim divisible by 2, here dim 1 of some
    "--steps",
    "0",  # the saved model is the one built: build_model rebuilds it unsharded (LoRA B random, not zero)
    "--layers",
    "1",
    "--hidden",
    "64",
    "--intermediate",
    "129",
    "--vocab",
    "255",
    "--experts",
    "3",
    "--save-contents",
    "model",
    "--no-generation-config",
]
GEMMA4 = ["--model", "gemma4", "--save-contents", "model", "--jobs", "2"]
FAKE_PG = {
    "replicated_ws64": [*GEMMA4, "--world-size", "64", "--replicate", "*norm.weight"],
    # lm_head.weight is the tied embedding: both its keys become plain tensors, and lm_head sorts first
    "replicated_first_key": [*GEMMA4, "--world-size", "4", "--replicate", "lm_head.weight,*norm.weight"],
}

# case -> (checkpoint, what verl 0.9.1's merger writes: "right", or the name of its wrong output)
CASES = {
    "replicated_ws64": ("replicated_ws64", "right"),
    "replicated_first_key": ("replicated_first_key", "rank0_rows"),
    "tied": ("qwen2-tied", "right"),
    "lora_unfused": ("llama+lora", "right"),
    "lora_fused": ("llama+lora", "adapter_not_merged"),
    "non_dim0_shard": ("qwen2", "right"),
    "uneven_vocab": ("llama", "right"),
    "moe_uneven_experts": ("qwen3-moe", "right"),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """Every case's checkpoint dir, the fake-group builds and the torchrun side by side."""
    root = tmp_path_factory.mktemp("verl_regressions")
    calls = "; ".join(f"main({[*args, '--out', str(root / name / 'actor')]!r})" for name, args in FAKE_PG.items())
    with ThreadPoolExecutor(2) as pool:
        fake = pool.submit(
            # 68 ranks forked one after another, each a few tenths of a second; 300 s is a hang
            run,
            [sys.executable, "-c", f"from slimckpt_testing.verl_checkpoints.fake_pg_checkpoint import main; {calls}"],
            {"SLIMCKPT_LOG_LEVEL": "WARNING"},
            300,
        )
        real = pool.submit(fsdp_checkpoint, tmp_path_factory, "verl_regressions", WORLD, *TORCHRUN_ARGS)
        proc = fake.result()
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        models = real.result()
    out = {name: root / name / "actor" for name in FAKE_PG}
    out.update({name: models / name for name in TORCHRUN_ARGS[1].split(",")})
    return out


def saved_tensors(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """What `save_pretrained` of `model` writes, by name."""
    model.save_pretrained(path)
    return dir_tensors(path)


def unsharded(case: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The model checkpoint `case` holds, as save_pretrained writes it (fp32). A LoRA model's
    `lora_fused` is peft's merge_and_unload() of it, `lora_unfused` its base model plus the adapter
    under the names of verl's `lora_adapter/` (prefixed so here)."""
    name = CASES[case][0]
    if name in FAKE_PG:
        import slimckpt_testing.verl_checkpoints.fake_pg_checkpoint as fake
        from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import auto_class, build_config

        args = fake.parse_args(["--out", "-", *FAKE_PG[name]])
        model = auto_class(args.model).from_config(build_config(args, args.model), dtype=torch.float32)
        fake.fill_model(model)  # the values the builder gave every rank's rows
        return saved_tensors(model, tmp_path / "unsharded")
    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import build_model, parse_args

    args = parse_args(["--out", "-", *TORCHRUN_ARGS])
    model = build_model(args, name)
    if case == "lora_fused":
        return saved_tensors(model.merge_and_unload(), tmp_path / "unsharded")
    if case == "lora_unfused":
        model.save_pretrained(tmp_path / "adapter")
        adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
        base = saved_tensors(model.unload(), tmp_path / "unsharded")
        return {**base, **{f"lora_adapter/{k}": v for k, v in adapter.items()}}
    return saved_tensors(model, tmp_path / "unsharded")


def written(target: Path) -> dict[str, torch.Tensor]:
    """A merge's tensors by name, `lora_adapter/`'s prefixed."""
    out = dir_tensors(target)
    if (target / "lora_adapter").is_dir():
        out.update({f"lora_adapter/{k}": v for k, v in dir_tensors(target / "lora_adapter").items()})
    return out


def mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Each key missing, extra, or not equal (dtype, shape, every element) to `want`'s."""
    bad = [f"{k}: missing" for k in sorted(set(want) - set(got))]
    bad += [f"{k}: not in the model" for k in sorted(set(got) - set(want))]
    for k in sorted(set(got) & set(want)):
        g, w = got[k], want[k]
        if g.dtype != w.dtype or g.shape != w.shape:
            bad.append(f"{k}: {g.dtype} {tuple(g.shape)}, the model's {w.dtype} {tuple(w.shape)}")
        elif not torch.equal(g, w):
            bad.append(f"{k}: values differ")
    return bad


def cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) for k, v in tensors.items()}


def rank_file(ckpt: Path, rank: int) -> dict:
    world = json.loads((ckpt / "fsdp_config.json").read_text())["world_size"]
    return torch.load(ckpt / f"model_world_size_{world}_rank_{rank}.pt", map_location="cpu", weights_only=False)


def rank0_rows(ckpt: Path, want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`want` as a merge of rank 0's file alone writes it: each sharded tensor cut to rank 0's shard
    (torch.chunk's first along its shard dim), each unsharded one whole."""
    from torch.distributed.tensor import DTensor

    world = json.loads((ckpt / "fsdp_config.json").read_text())["world_size"]
    rank0 = rank_file(ckpt, 0)
    out = {}
    for k, v in want.items():
        saved = rank0[k]
        out[k] = v.chunk(world, dim=saved.placements[0].dim)[0] if isinstance(saved, DTensor) else v
    return out


def adapter_fields(path: Path) -> dict:
    """What an adapter_config.json says of the adapter's arithmetic and where it applies."""
    config = adapter_config_fields(path.read_bytes())
    return {k: config[k] for k in ("r", "lora_alpha", "target_modules", "task_type")}


def slim_merge(ckpt: Path, target: Path, **kw) -> None:
    result = merge(MergeOptions(local_dir=str(ckpt), target_dir=str(target), progress=False, **kw))
    assert not result.used_verl_merger, f"{ckpt}: slimckpt fell back to verl's merger"


@pytest.mark.parametrize("case", list(CASES))
def test_verl_merger_and_slimckpt_against_the_unsharded_model(ckpts, tmp_path, case):
    name, verl_verdict = CASES[case]
    ckpt = ckpts[name]
    want = unsharded(case, tmp_path)
    fused = case == "lora_fused"

    slim_merge(ckpt, tmp_path / "slim_fp32", dtype="fp32", merge_lora=fused)
    bad = mismatches(written(tmp_path / "slim_fp32"), want)
    assert not bad, f"{case}: slimckpt's fp32 merge differs from the unsharded model: {bad[:6]}"
    if not fused:  # --merge_lora in bf16 rounds W, B and A first, as peft on verl's bf16 output (test_merge_lora)
        slim_merge(ckpt, tmp_path / "slim", merge_lora=fused)
        bad = mismatches(written(tmp_path / "slim"), cast(want, torch.bfloat16))
        assert not bad, f"{case}: slimckpt's merge differs from the unsharded model: {bad[:6]}"

    assert verl_merge(ckpt, tmp_path / "verl") is None
    verl = written(tmp_path / "verl")
    if case == "lora_unfused":
        ref = adapter_fields(tmp_path / "adapter" / "adapter_config.json")
        for tool in ("slim", "verl"):
            got = adapter_fields(tmp_path / tool / "lora_adapter" / "adapter_config.json")
            assert got == ref, f"{case}: {tool}'s adapter_config.json has {got}, the unsharded model's {ref}"
    if verl_verdict == "right":
        bad = mismatches(verl, cast(want, torch.bfloat16))
        assert not bad, f"{case}: verl's merger, recorded as right, differs from the unsharded model: {bad[:6]}"
    elif verl_verdict == "rank0_rows":
        # the mesh comes from the alphabetically first key; a plain tensor there gives a mesh of one
        # rank, so only rank 0's file is read and every sharded tensor is rank 0's rows, exit status 0
        bad = mismatches(verl, cast(rank0_rows(ckpt, want), torch.bfloat16))
        assert not bad, f"{case}: verl's merger no longer writes rank 0's rows alone: {bad[:6]}"
        assert mismatches(verl, cast(want, torch.bfloat16)), case
    else:  # adapter_not_merged: verl has no fused output; the base weights and lora_adapter/ beside
        from verl.model_merger.base_model_merger import ModelMergerConfig

        assert not [f.name for f in dataclasses.fields(ModelMergerConfig) if "lora" in f.name], (
            f"{case}: verl's merger has a LoRA option now"
        )
        base = unsharded("lora_unfused", tmp_path / "base")
        bad = mismatches(verl, cast(base, torch.bfloat16))
        assert not bad, f"{case}: verl's merger no longer writes the unmerged base and adapter: {bad[:6]}"
        adapted = sorted(k for k in want if not torch.equal(want[k], base[k]))
        assert adapted and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in adapted), adapted


def test_the_checkpoints_hold_what_each_case_names(ckpts):
    """Each case's condition is in its files (else a case could pass without testing anything)."""
    from torch.distributed.tensor import DTensor

    def shard_sizes(ckpt: Path, key: str, world: int) -> tuple[int, list[int]]:
        saved = [rank_file(ckpt, r)[key] for r in range(world)]
        dim = saved[0].placements[0].dim
        return dim, [t._local_tensor.shape[dim] for t in saved]

    ws64 = ckpts["replicated_ws64"]
    assert json.loads((ws64 / "fsdp_config.json").read_text())["world_size"] == 64
    for rank in (0, 63):
        sd = rank_file(ws64, rank)
        plain = sorted(k for k, v in sd.items() if not isinstance(v, DTensor))
        assert plain == sorted(k for k in sd if k.endswith(("norm.weight", "layer_scalar"))), plain
        assert any(k.endswith("layer_scalar") for k in plain) and isinstance(sd[min(sd)], DTensor)
    first = rank_file(ckpts["replicated_first_key"], 0)
    assert min(first) == "lm_head.weight" and not isinstance(first["lm_head.weight"], DTensor)
    assert json.loads((ckpts["qwen2-tied"] / "huggingface" / "config.json").read_text())["tie_word_embeddings"]
    divisible = {k: v.placements[0].dim for k, v in rank_file(ckpts["qwen2"], 0).items()}
    assert divisible["model.layers.0.mlp.gate_proj.weight"] == 1 and divisible["model.embed_tokens.weight"] == 1
    assert shard_sizes(ckpts["llama"], "model.embed_tokens.weight", WORLD) == (0, [128, 127])
    assert shard_sizes(ckpts["qwen3-moe"], "model.layers.0.mlp.experts.gate_up_proj", WORLD) == (0, [2, 1])
    assert any(".lora_A." in k for k in rank_file(ckpts["llama+lora"], 0))


def test_no_fallback_to_verls_merger_where_it_would_read_rank0_alone(ckpts, tmp_path, monkeypatch):
    """A checkpoint slimckpt cannot stream goes to verl's merger, but not one whose first key is
    unsharded (verl would write rank 0's rows of every tensor): that is refused in one line."""
    from slimckpt.hf.naming import NeedsVerlMerger
    from slimckpt.merge import steps
    from slimckpt.merge.plan import MergeError

    def cannot_stream(*args, **kwargs):
        raise NeedsVerlMerger("a save the streaming merge does not reproduce")

    monkeypatch.setattr(steps, "make_plan", cannot_stream)
    with pytest.raises(MergeError, match="first key, 'lm_head.weight', which is not sharded") as refused:
        merge(
            MergeOptions(local_dir=str(ckpts["replicated_first_key"]), target_dir=str(tmp_path / "o"), progress=False)
        )
    assert "\n" not in str(refused.value) and not (tmp_path / "o").exists()
    result = merge(MergeOptions(local_dir=str(ckpts["llama"]), target_dir=str(tmp_path / "v"), progress=False))
    assert result.used_verl_merger and (tmp_path / "v" / "model.safetensors").is_file()
