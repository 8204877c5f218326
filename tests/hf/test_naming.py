"""hf/naming: the output names of `slimckpt merge` as save_pretrained makes them, on checkpoints made
in-process: an MoE layer's fused experts split per expert (`HfSide.output_sources`), a config that does not
fit the shards refused in one line, FlowRL's log Z head left out."""

from __future__ import annotations

import pytest
import torch

from slimckpt.layout.merge_manifest import verify
from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import build_tokenizer

from ..helpers.merge_cli import (
    assert_nothing_committed,
    error_line,
    log_lines,
    merge_cli,
    tiny_mixtral_config,
)
from ..helpers.merge_helpers import (
    assert_same_tensors,
    dir_tensors,
    synthetic_checkpoint,
    verl_merge,
)

slim_log = pytest.fixture(autouse=True, name="slim_log")(log_lines)


def test_moe_experts_are_streamed_and_match_verl(tmp_path, capsys, slim_log):
    """transformers 5 fuses Mixtral's experts in memory ([E, 2I, H], [E, H, I]) and splits them per
    expert on save: each split is a run of the fused tensor's elements, streamed like any tensor.
    Unsharded copies on two ranks (compared as verl does), tiny chunks so that parts cross chunks."""
    root = synthetic_checkpoint(tmp_path / "actor", world_size=2, config=tiny_mixtral_config())
    build_tokenizer(64).save_pretrained(root / "huggingface")
    assert verl_merge(root, tmp_path / "verl") is None
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "o"))
    assert rc == 0, err
    assert "verl's own FSDPModelMerger" not in err and "slimckpt merge committed" in err
    out = dir_tensors(tmp_path / "o")
    assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in out
    assert_same_tensors(out, dir_tensors(tmp_path / "verl"))
    assert (tmp_path / "o" / "model.safetensors").read_bytes() == (tmp_path / "verl" / "model.safetensors").read_bytes()
    assert verify(str(tmp_path / "o")) == []
    # 100-byte chunks: every expert's rows cross chunks (and the source's rows)
    from slimckpt.merge.pipeline import merge
    from slimckpt.merge.plan import MergeOptions

    merge(MergeOptions(local_dir=str(root), target_dir=str(tmp_path / "small"), chunk_bytes=100, progress=False))
    assert (tmp_path / "small" / "model.safetensors").read_bytes() == (
        tmp_path / "o" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    "config_edit,what",
    [
        ({"num_local_experts": 4}, "makes it [4, 16, 32]"),  # expert count
        ({"intermediate_size": 24}, "makes it [3, 16, 24]"),
    ],
)  # expert sizes
def test_moe_config_that_does_not_fit_the_shards(tmp_path, capsys, config_edit, what):
    """config.json from another model: the fused tensor's split would follow the shards, loading the
    config's; one line naming the tensor and the rank file, nothing committed."""
    root = synthetic_checkpoint(tmp_path / "actor", world_size=2, config=tiny_mixtral_config())
    tiny_mixtral_config(**config_edit).save_pretrained(root / "huggingface")
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "o"))
    assert rc == 1
    line = error_line(err)
    assert (
        "model_world_size_2_rank_0.pt: 'model.layers.0.mlp.experts.down_proj' is [3, 16, 32]" in line and what in line
    )
    assert "config.json" in line and "verl's own FSDPModelMerger" not in err
    assert_nothing_committed(tmp_path / "o")


def test_flowrl_log_z_head_left_out(tmp_path, capsys):
    """FlowRL's log Z head is checkpointed with the actor; HF exports (ours and verl's, patched) drop it."""
    extra = {"flowrl_log_z.net.0.weight": torch.randn(8, 32), "flowrl_log_z.net.0.bias": torch.randn(8)}
    root = synthetic_checkpoint(tmp_path / "actor", world_size=2, extra=extra)
    rc, err = merge_cli(capsys, "--local_dir", str(root), "--target_dir", str(tmp_path / "o"))
    assert rc == 0 and "leaves out FlowRL's log Z head (2 tensors)" in err
    out = dir_tensors(tmp_path / "o")
    assert not any("flowrl_log_z" in k for k in out) and "model.norm.weight" in out
