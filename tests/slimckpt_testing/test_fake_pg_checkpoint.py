"""slimckpt_testing.verl_checkpoints.fake_pg_checkpoint: a checkpoint written one rank at a time over torch's fake
process group, from a meta model, is the one verl's manager writes over a real gloo group from a
materialised model (same files, same tensor records byte for byte, same DTensor metadata), and its
merge holds the builder's values, checked by slimckpt_testing.merge_check."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ..conftest import REPO

WORLD = 3  # the tiny preset's 256-row embedding splits 86/86/84: uneven shards on purpose
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "SLIMCKPT_LOG_LEVEL": "WARNING"}
BUILDER = ["-m", "slimckpt_testing.verl_checkpoints.fake_pg_checkpoint", "--save-contents", "model,extra"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """(fake-group checkpoint, gloo checkpoint) of the tiny Llama at world size 3, built side by side."""
    root = tmp_path_factory.mktemp("fake_pg")
    fake, real = root / "fake" / "actor", root / "real" / "actor"
    procs = [
        subprocess.Popen(
            [sys.executable, *BUILDER, "--out", str(fake), "--world-size", str(WORLD), "--jobs", str(WORLD)],
            cwd=REPO,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={WORLD}",
                *BUILDER,
                "--out",
                str(real),
                "--materialize",
            ],
            cwd=REPO,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ),
    ]
    for proc in procs:
        # the fake build and a 3-rank torchrun side by side on 2 cores (~50 s loaded); 300 s is a hang
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-4000:]
    return fake, real


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _describe(value):
    """What a loaded entry is, short of its bytes: a DTensor's mesh, placements and block layout."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        mesh, local = value.device_mesh, value._local_tensor
        return (
            "DTensor",
            tuple(value.shape),
            value.dtype,
            tuple(value.placements),
            mesh.mesh.tolist(),
            mesh.mesh_dim_names,
            mesh.get_coordinate(),
            tuple(local.shape),
            local.stride(),
            local.storage_offset(),
            local.untyped_storage().nbytes(),
        )
    if isinstance(value, torch.Tensor):
        return ("Tensor", tuple(value.shape), value.dtype, value.stride())
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in value.items()}
    return type(value).__name__


@pytest.mark.slow
def test_fake_group_writes_what_a_real_group_writes(pair):
    fake, real = pair
    assert _files(fake) == _files(real)
    assert any(name.startswith("extra_state_world_size_3_rank_") for name in _files(fake))
    for rel in _files(fake):
        a, b = fake / rel, real / rel
        if not rel.endswith(".pt"):  # fsdp_config.json and huggingface/: config, tokenizer, generation config
            assert a.read_bytes() == b.read_bytes(), rel
            continue
        za, zb = zipfile.ZipFile(a), zipfile.ZipFile(b)
        assert za.namelist() == zb.namelist(), rel
        for entry in za.namelist() if rel.startswith("model_") else ():
            # the pickle holds each mesh's process-local hash, serialization_id is random per save
            if entry.endswith(("/data.pkl", "/.data/serialization_id")):
                continue
            assert za.read(entry) == zb.read(entry), f"{rel}: record {entry} differs"
        loaded_a = torch.load(a, map_location="cpu", weights_only=False)
        loaded_b = torch.load(b, map_location="cpu", weights_only=False)
        if rel.startswith("model_"):
            assert _describe(loaded_a) == _describe(loaded_b), rel
            rank = int(rel.rsplit("_", 1)[1].removesuffix(".pt"))
            assert {v.device_mesh.get_coordinate() for v in loaded_a.values()} == {(rank,)}, rel
        else:  # extra state: the scheduler's and RNG state of two different processes
            assert sorted(loaded_a) == sorted(loaded_b) == ["lr_scheduler", "rng"], rel


@pytest.mark.slow
def test_merge_of_fake_group_checkpoint_holds_the_builder_values(pair, tmp_path):
    from safetensors import safe_open

    from slimckpt_testing.merge_check import check_merged
    from slimckpt_testing.verl_checkpoints.fake_pg_checkpoint import expected_values

    fake, _ = pair
    target = tmp_path / "merged"
    proc = subprocess.run(
        [sys.executable, "-m", "slimckpt.cli", "merge", "--local_dir", str(fake), "--target_dir", str(target)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        # one interpreter merges a tiny checkpoint: seconds after its imports; 300 s is a hang
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = check_merged(str(fake), str(target))
    assert result.ok, result.problems
    assert result.tensors == 21 and result.elements == 106816
    files = sorted(target.glob("*.safetensors"))
    seen = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                got = f.get_tensor(name)
                assert torch.equal(got, expected_values(name, got.shape).to(got.dtype)), name
                seen += 1
    assert seen == 21
    # one rank's block changed on disk is named by the checker
    rank1 = fake.parent.parent / "edited"
    rank1.mkdir()
    for p in fake.iterdir():
        (rank1 / p.name).symlink_to(p)
    path = rank1 / f"model_world_size_{WORLD}_rank_1.pt"
    path.unlink()
    state = torch.load(fake / path.name, map_location="cpu", weights_only=False)
    state["model.norm.weight"]._local_tensor[0] += 1.0
    torch.save(state, path)
    bad = check_merged(str(rank1), str(target))
    assert not bad.ok and any(p.startswith("model.norm.weight: rank 1") for p in bad.problems), bad.problems


def test_a_bf16_build_is_saved_in_bf16_with_the_builder_values(tmp_path):
    """--dtype bfloat16: verl's manager saves the bf16 shards as they are (the benchmarks' peers keep
    dtypes), each holding the values expected_values gives in bf16."""
    from slimckpt.engine.verl_sources import open_checkpoint
    from slimckpt_testing.verl_checkpoints.fake_pg_checkpoint import expected_values

    out = tmp_path / "actor"
    cmd = [*BUILDER[:2], "--save-contents", "model", "--out", str(out), "--world-size", "2", "--dtype", "bfloat16"]
    # two ranks of the tiny model, one after the other: seconds after the imports; 300 s is a hang
    proc = subprocess.run([sys.executable, *cmd], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = open_checkpoint(str(out))
    assert ckpt.tensors and {t.dtype for t in ckpt.tensors.values()} == {torch.bfloat16}
    for name, src in ckpt.tensors.items():
        whole = torch.cat(src.pieces, dim=src.shard_dim) if src.sharded else src.pieces[0]
        assert torch.equal(whole, expected_values(name, src.shape, torch.bfloat16)), name
