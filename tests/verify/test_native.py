"""verify/native: verl's own role dirs (rank files, fsdp_config.json, the HF side), checked without checksums;
a safetensors header's checks."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch

from slimckpt.verify.command import KIND_NATIVE, detect, verify_path
from slimckpt.verify.native import check_safetensors_header

from ..helpers.merge_helpers import synthetic_checkpoint
from .conftest import flip as _flip
from .conftest import lines


def _record_offset(path, suffix: str) -> int:
    import zipfile

    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
    return info.header_offset + 30 + name_len + extra_len


@pytest.fixture
def native(tmp_path):
    return synthetic_checkpoint(tmp_path / "global_step_1" / "actor", world_size=2)


def test_native_clean_says_what_it_could_not_check(native):
    report = verify_path(str(native))
    assert report.ok, lines(report)
    assert detect(str(native)) == KIND_NATIVE
    assert any("no checksums" in n for n in report.notes)


@pytest.mark.parametrize(
    "damage,named,reason",
    [
        ("swap", "model_world_size_2_rank_0.pt", "renamed or swapped"),
        ("delete", "model_world_size_2_rank_1.pt", "missing"),
        ("stale", "model_world_size_4_rank_3.pt", "stale file"),
        ("truncate", "model_world_size_2_rank_1.pt", "zip"),
        ("data_flip", "model_world_size_2_rank_1.pt", "CRC"),
        ("world", "fsdp_config.json", "says world size 3, the rank files are of world size 2"),
        ("config", "config.json", "not valid JSON"),
        ("tokenizer", "tokenizer_config.json", "missing"),
        ("shape", "model_world_size_2_rank_1.pt", "shape"),
    ],
)
def test_native_damage_is_named(native, tmp_path, damage, named, reason):
    r0, r1 = native / "model_world_size_2_rank_0.pt", native / "model_world_size_2_rank_1.pt"
    if damage == "swap":
        r0.rename(native / "t")
        r1.rename(r0)
        (native / "t").rename(r1)
    elif damage == "delete":
        r1.unlink()
    elif damage == "stale":
        shutil.copyfile(r0, native / "model_world_size_4_rank_3.pt")
    elif damage == "truncate":
        os.truncate(r1, os.path.getsize(r1) - 100)
    elif damage == "data_flip":  # a byte of a tensor's record (not zip padding between records)
        _flip(r1, _record_offset(r1, "/data/0") + 5)
    elif damage == "world":
        (native / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 3}))
    elif damage == "tokenizer":
        (native / "huggingface" / "tokenizer.json").write_text("{}")  # a tokenizer file without its config
    elif damage == "config":
        cfg = native / "huggingface" / "config.json"
        cfg.write_text(cfg.read_text()[:-5])
    else:
        sd = torch.load(r1, weights_only=True)
        key = next(iter(sd))
        sd[key] = torch.zeros(3, 3)
        torch.save(sd, r1)
    report = verify_path(str(native))
    msgs = lines(report)
    assert not report.ok
    hit = [m for m in msgs if named in m]
    assert hit and any(reason in m for m in hit), msgs


def test_safetensors_header_checks(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(3)}, str(path))
    assert check_safetensors_header(str(path)) is None
    os.truncate(path, os.path.getsize(path) - 4)
    assert "ends at" in check_safetensors_header(str(path))
    save_file({"a": torch.zeros(4, 4)}, str(path))
    _flip(path, 0)  # header length
    assert check_safetensors_header(str(path)) is not None


def test_header_length_helper_matches_safetensors(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with open(tmp_path / "x.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    assert n + 8 + 8 == os.path.getsize(tmp_path / "x.safetensors")
