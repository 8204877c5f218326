"""hf/plan: the output `slimckpt merge` plans (names, dtypes, the file split of save_pretrained's
max_shard_size), on a checkpoint made in-process: what verl's merger writes, byte for byte."""

from __future__ import annotations

import json

import pytest
import torch

from slimckpt.layout.merge_manifest import verify

from ..helpers.merge_cli import (
    log_lines,
    merge_cli,
    ws2_checkpoint,
)
from ..helpers.merge_helpers import (
    assert_same_tensors,
    dir_tensors,
    verl_merge,
)

slim_log = pytest.fixture(autouse=True, name="slim_log")(log_lines)
ckpt = pytest.fixture(scope="module", name="ckpt")(ws2_checkpoint)


def test_plain_checkpoint_matches_verl(ckpt, tmp_path, capsys):
    assert verl_merge(ckpt, tmp_path / "verl") is not None  # verl raises: no tokenizer (after writing)
    rc, err = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "ours"))
    assert rc == 0
    assert "no tokenizer" in err  # a warning, not a failure
    assert_same_tensors(dir_tensors(tmp_path / "ours"), dir_tensors(tmp_path / "verl"))
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "verl" / name).read_bytes(), name
    assert verify(str(tmp_path / "ours")) == []


@pytest.mark.parametrize("dtype,torch_dtype", [("fp16", torch.float16), ("fp32", torch.float32)])
def test_dtype_option(ckpt, tmp_path, capsys, dtype, torch_dtype):
    rc, _ = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "o"), "--dtype", dtype)
    assert rc == 0
    src = torch.load(ckpt / "model_world_size_2_rank_0.pt", weights_only=False)
    out = dir_tensors(tmp_path / "o")
    for name, t in out.items():
        assert t.dtype == torch_dtype
        assert torch.equal(t, src[name].to(torch_dtype))
    assert json.loads((tmp_path / "o" / "config.json").read_text())["dtype"] == str(torch_dtype).split(".")[1]


def test_max_shard_size_splits_like_save_pretrained(ckpt, tmp_path, capsys):
    rc, _ = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "o"), "--max_shard_size", "10KB")
    assert rc == 0
    index = json.loads((tmp_path / "o" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all((tmp_path / "o" / f).stat().st_size <= 10_000 + 4096 for f in files)
    src = torch.load(ckpt / "model_world_size_2_rank_0.pt", weights_only=False)
    out = dir_tensors(tmp_path / "o")
    assert sorted(out) == sorted(index["weight_map"]) == sorted(src)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in src.values())
