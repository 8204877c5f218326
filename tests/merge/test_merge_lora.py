"""LoRA checkpoints: `slimckpt merge` streams them to what verl 0.9.1's merger writes (the base model
with peft's names undone, and `lora_adapter/` with the adapter and its `adapter_config.json`), and
`--merge_lora` writes W + (B @ A) * alpha / r into the base weights exactly as peft's
`merge_and_unload()` makes them. The checkpoints: one torchrun saves a Llama and a Qwen3-MoE (peft on
q_proj/v_proj, r=4, alpha=8, one AdamW step so B is not zero) through verl's FSDPCheckpointManager,
FSDP2 at world size 2. The adapter's side of the export: hf/lora."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from slimckpt.layout.merge_manifest import MANIFEST_NAME, verify
from slimckpt.merge.pipeline import merge
from slimckpt.merge.plan import MergeError, MergeOptions

from ..helpers.merge_helpers import (
    adapter_config_fields,
    fsdp_checkpoint,
    full_disk_after_headers,
    torchrun,
    tree_bytes,
    verl_merge,
)
from ..helpers.slim_logs import lines_of

MODELS = ("llama", "qwen3-moe")
FIXTURE_ARGS = [
    "--models",
    ",".join(MODELS),
    "--lora-rank",
    "4",
    "--experts",
    "3",
    "--steps",
    "1",
    "--layers",
    "2",
    "--hidden",
    "64",
    "--vocab",
    "256",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_ckpts(tmp_path_factory):
    return fsdp_checkpoint(tmp_path_factory, "lora_models", 2, *FIXTURE_ARGS)


@pytest.fixture
def slim_log():
    """slimckpt's log lines (tests/helpers/slim_logs.py: read from the logger object, not from caplog)."""
    with lines_of(logging.getLogger("slimckpt")) as buf:
        yield buf


def ours(local_dir, target, **kw):
    return merge(MergeOptions(local_dir=str(local_dir), target_dir=str(target), progress=False, **kw))


def comparable_tree(path) -> dict[str, bytes]:
    """merge_helpers.tree_bytes, adapter_config.json's with target_modules sorted (adapter_config_fields:
    verl's merger lists them in the order of a set built from another set, which follows
    PYTHONHASHSEED), once its bytes are checked to be json.dump(..., ensure_ascii=False, indent=4)'s
    as verl writes them."""
    out = tree_bytes(path)
    for name, raw in out.items():
        if name.rsplit("/", 1)[-1] == "adapter_config.json":
            assert raw.decode() == json.dumps(json.loads(raw), ensure_ascii=False, indent=4), name
            out[name] = json.dumps(adapter_config_fields(raw), ensure_ascii=False, indent=4).encode()
    return out


@pytest.mark.parametrize("model", MODELS)
def test_same_as_verl_merger(lora_ckpts, tmp_path, model, slim_log):
    """Every file verl's merger writes, byte for byte (adapter_config.json's target_modules in any
    order: comparable_tree), streamed: verl's merger is not run."""
    ckpt = lora_ckpts / model
    assert verl_merge(ckpt, tmp_path / "verl") is None
    result = ours(ckpt, tmp_path / "ours", chunk_bytes=1000)
    assert not result.used_verl_merger
    assert (tmp_path / "verl" / "lora_adapter" / "adapter_model.safetensors").is_file()
    assert comparable_tree(tmp_path / "ours") == comparable_tree(tmp_path / "verl")
    assert verify(str(tmp_path / "ours")) == []
    manifest = json.loads((tmp_path / "ours" / MANIFEST_NAME).read_text())
    assert manifest["info"]["lora_adapter"] == ["lora_adapter/adapter_model.safetensors"]
    assert "lora_adapter/adapter_config.json" in [f["path"] for f in manifest["files"]]
    assert "rank 4" not in slim_log.getvalue()  # lora_train_meta.json was there: no inference line


def _peft_merged(unmerged_dir, dtype) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(unmerged_dir, dtype=dtype)
    model = PeftModel.from_pretrained(base, unmerged_dir / "lora_adapter")
    return {k: v for k, v in model.merge_and_unload().state_dict().items()}


def _loaded(path, dtype) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return dict(model.state_dict())


@pytest.mark.parametrize("model,dtype", [("llama", "fp32"), ("llama", "bf16"), ("qwen3-moe", "bf16")])
def test_merge_lora_equals_peft_merge_and_unload(lora_ckpts, tmp_path, model, dtype):
    """--merge_lora against peft on the same weights (the unmerged output in that dtype, adapter
    loaded by PeftModel.from_pretrained, merge_and_unload()): fp32 within 1e-6, bf16 within one
    bf16 step (both measured bit-equal here), in chunks of a few rows; no lora_adapter/."""
    ckpt = lora_ckpts / model
    ours(ckpt, tmp_path / "unmerged", dtype=dtype)
    ours(ckpt, tmp_path / "merged", dtype=dtype, merge_lora=True, chunk_bytes=1000)
    assert not (tmp_path / "merged" / "lora_adapter").exists()
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    want = _peft_merged(tmp_path / "unmerged", torch_dtype)
    # compared as loaded (from_pretrained fuses an MoE's experts again, as peft's model holds them)
    got, unmerged = _loaded(tmp_path / "merged", torch_dtype), _loaded(tmp_path / "unmerged", torch_dtype)
    assert set(got) == set(want), set(got) ^ set(want)
    changed = [k for k in got if not torch.equal(got[k], unmerged[k])]
    assert sorted(changed) == sorted(k for k in got if k.endswith(("q_proj.weight", "v_proj.weight")))
    tol = dict(rtol=0, atol=1e-6) if dtype == "fp32" else dict(rtol=2**-7, atol=0)
    for k, t in got.items():
        assert t.dtype == torch_dtype
        torch.testing.assert_close(t, want[k], **tol, msg=k)
    assert verify(str(tmp_path / "merged")) == []
    assert json.loads((tmp_path / "merged" / MANIFEST_NAME).read_text())["info"]["merge_lora"] is True


def test_distributed_merge_lora(lora_ckpts, tmp_path):
    """--merge_lora over 2 torchrun ranks, files split small: the single-process bytes."""
    ckpt = lora_ckpts / "llama"
    ours(ckpt, tmp_path / "one", merge_lora=True, max_shard_size="20KB")
    proc = torchrun(
        2,
        [
            "-m",
            "slimckpt.cli",
            "merge",
            "--distributed_merge",
            "--merge_lora",
            "--no_progress",
            "--max_shard_size",
            "20KB",
            "--local_dir",
            str(ckpt),
            "--target_dir",
            str(tmp_path / "d"),
        ],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len([n for n in comparable_tree(tmp_path / "one") if n.endswith(".safetensors")]) > 2
    assert comparable_tree(tmp_path / "d") == comparable_tree(tmp_path / "one")


def test_without_train_meta_rank_and_alpha_are_inferred_as_verl_does(lora_ckpts, tmp_path, slim_log):
    """No lora_train_meta.json: rank from the last adapter tensor's shape, alpha 0, as verl's merger
    writes them, said in one line; --merge_lora (which would add 0 x B @ A) is refused in one line,
    nothing left behind."""
    ckpt = shutil.copytree(lora_ckpts / "llama", tmp_path / "actor")
    (ckpt / "lora_train_meta.json").unlink()
    assert verl_merge(ckpt, tmp_path / "verl") is None
    ours(ckpt, tmp_path / "ours")
    assert comparable_tree(tmp_path / "ours") == comparable_tree(tmp_path / "verl")
    config = json.loads((tmp_path / "ours" / "lora_adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 0)
    lines = [line for line in slim_log.getvalue().splitlines() if "lora_train_meta.json" in line]
    assert len(lines) == 1 and "rank 4 inferred from" in lines[0] and "lora_alpha 0" in lines[0], lines
    with pytest.raises(MergeError, match="--merge_lora: lora_alpha is unknown") as exc:
        ours(ckpt, tmp_path / "m", merge_lora=True)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.partial").exists()
    (ckpt / "lora_train_meta.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "use_rslora": True}))
    with pytest.raises(MergeError, match="sets use_rslora, which this merge does not support"):
        ours(ckpt, tmp_path / "m", merge_lora=True)


@pytest.mark.parametrize("merge_lora", [False, True])
def test_a_failed_lora_merge_leaves_nothing_that_looks_complete(lora_ckpts, tmp_path, monkeypatch, merge_lora):
    """A full disk while the weights are written: a one-line error, no target and no .partial."""
    full_disk_after_headers(monkeypatch)
    with pytest.raises(MergeError, match="No space left") as exc:
        ours(lora_ckpts / "qwen3-moe", tmp_path / "o", merge_lora=merge_lora)
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
