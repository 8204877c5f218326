"""The merge's torch-free early writer (slimckpt.write.np_cast, slimckpt.write.np_writer): the same bytes as
torch's casts and as the torch writer, and a refusal (never different bytes) where it cannot."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from slimckpt.format import layout
from slimckpt.merge import early_write
from slimckpt.merge import pipeline as merge
from slimckpt.read import pt_index
from slimckpt.read.sources import open_checkpoint
from slimckpt.write import np_cast, np_writer, writer_stats
from slimckpt.write.out_files import create_files
from slimckpt.write.share_writer import OUT_DTYPES, ShareWriter

from ..helpers.merge_helpers import full_disk_after_headers, synthetic_checkpoint, tiny_llama_config
from ..helpers.slim_logs import lines_of


def _bits(n: int, seed: int) -> np.ndarray:
    """fp32 values from random bit patterns (every exponent, subnormals, infinities), NaN removed,
    plus the rounding edge cases."""
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    edges = np.array(
        [
            0x3F808000,
            0x3F818000,
            0x3F80FFFF,
            0x7F7FFFFF,
            0x7F7F8000,
            0x00008000,
            0x80018000,
            0x477FF000,
            0x477FEFFF,
            0x33000001,
            0x387FC000,
            0x7F800000,
            0xFF800000,
            0,
            0x80000000,
        ],
        dtype=np.uint32,
    )
    f = np.concatenate([u, edges]).view(np.float32)
    return f[~np.isnan(f)]


@pytest.mark.parametrize("out", ["bf16", "fp16", "fp32"])
def test_cast_from_fp32_equals_torch_bit_for_bit(out):
    f = _bits(1 << 18, 0)
    caster = np_cast.Caster("torch.float32", out)
    got = bytearray(caster.out_nbytes(f.nbytes))
    caster.cast(memoryview(f).cast("B"), memoryview(got))
    want = torch.from_numpy(f.copy()).to(OUT_DTYPES[out]).view(torch.uint8).numpy().tobytes()
    assert bytes(got) == want


def test_cast_from_bf16_equals_torch():
    bits = np.random.default_rng(1).integers(0, 2**16, size=1 << 16, dtype=np.uint64).astype(np.uint16)
    src = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
    for out in ("bf16", "fp32"):
        caster = np_cast.Caster("torch.bfloat16", out)
        got = bytearray(caster.out_nbytes(bits.nbytes))
        caster.cast(memoryview(bits).cast("B"), memoryview(got))
        assert bytes(got) == src.to(OUT_DTYPES[out]).view(torch.uint8).numpy().tobytes()


def test_nan_is_refused_not_cast_differently():
    f = np.ones(1000, np.float32)
    f[777] = np.nan
    caster = np_cast.Caster("torch.float32", "bf16")
    with pytest.raises(np_cast.HasNaN):
        caster.cast(memoryview(f).cast("B"), memoryview(bytearray(2000)))
    assert not np_cast.supported("torch.float16", "bf16")  # a pair torch must do
    with pytest.raises(ValueError):
        np_cast.Caster("torch.float16", "bf16")


def test_nan_in_a_later_block_is_found_and_infinities_are_not_nan():
    caster = np_cast.Caster("torch.float32", "bf16")
    f = np.full(3 * np_cast.BLOCK + 5, 0.5, np.float32)
    f[2 * np_cast.BLOCK + 3] = np.nan
    with pytest.raises(np_cast.HasNaN):
        caster.cast(memoryview(f).cast("B"), memoryview(bytearray(2 * f.size)))
    # +inf and -inf make the screening sum NaN; the chunk holds no NaN, so it is cast, as torch does
    f[2 * np_cast.BLOCK + 3], f[7] = np.inf, -np.inf
    assert np.isnan(np.add.reduce(f))
    got = bytearray(2 * f.size)
    caster.cast(memoryview(f).cast("B"), memoryview(got))
    assert bytes(got) == torch.from_numpy(f).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


# ------------------------------------------------------------------------------------------------
def _plan(ckpt, dtype: str, max_shard: int | str = "50GB") -> tuple[layout.Plan, dict[str, str]]:
    names = {n: n for n in ckpt.tensors}
    specs = [
        layout.TensorSpec(n, {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}[dtype], ckpt.tensors[n].shape)
        for n in names
    ]
    return layout.plan_files(specs, max_shard), names


def _torch_bytes(tmp_path, local_dir, dtype: str, max_shard) -> dict[str, bytes]:
    ckpt = open_checkpoint(str(local_dir))
    plan, names = _plan(ckpt, dtype, max_shard)
    root = tmp_path / f"torch_{dtype}"
    root.mkdir()
    create_files(str(root), plan)
    w = ShareWriter(
        str(root), plan, {n: ckpt.tensors[o] for n, o in names.items()}, OUT_DTYPES[dtype], chunk_bytes=4096
    )
    w.write_share(layout.partition(plan, 1)[0])
    ckpt.close()
    return {f.name: (root / f.name).read_bytes() for f in plan.files} | {"checksums": json.dumps(w.checksums)}


def _np_bytes(tmp_path, local_dir, dtype: str, max_shard, chunk_bytes: int = 4096) -> dict[str, bytes]:
    index = pt_index.open_index(str(local_dir))
    assert index is not None
    plan, names = _plan(index, dtype, max_shard)
    root = tmp_path / f"np_{dtype}_{chunk_bytes}"
    root.mkdir()
    create_files(str(root), plan)
    checksums = np_writer.write_plan(
        str(root), plan, {n: index.tensors[o] for n, o in names.items()}, dtype, chunk_bytes
    )
    return {f.name: (root / f.name).read_bytes() for f in plan.files} | {"checksums": json.dumps(checksums)}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_np_writer_writes_the_torch_writers_bytes(tmp_path, dtype):
    local = synthetic_checkpoint(tmp_path / "ckpt", world_size=2, config=tiny_llama_config())
    want = _torch_bytes(tmp_path, local, dtype, "50GB")
    assert _np_bytes(tmp_path, local, dtype, "50GB") == want
    assert _np_bytes(tmp_path, local, dtype, "50GB", chunk_bytes=1 << 20) == want
    (tmp_path / "split").mkdir()
    several = _np_bytes(tmp_path / "split", local, dtype, 20_000)  # several files, tensors across chunks
    assert len(several) > 2 and several == _torch_bytes(tmp_path / "split", local, dtype, 20_000)


def test_np_writer_refuses_nan_and_differing_copies(tmp_path):
    local = synthetic_checkpoint(tmp_path / "ckpt", world_size=2, config=tiny_llama_config())
    index = pt_index.open_index(str(local))
    plan, names = _plan(index, "bf16")
    sources = {n: index.tensors[o] for n, o in names.items()}
    name = next(n for n, s in sources.items() if len(s.shape) == 2)
    piece = sources[name].pieces[-1]
    with open(piece.path, "r+b") as f:  # a NaN in the last rank's copy
        f.seek(piece.offset + 4)
        f.write(np.array([np.nan], np.float32).tobytes())
    root = tmp_path / "out"
    root.mkdir()
    create_files(str(root), plan)
    with pytest.raises(np_writer.Declined, match="NaN"):
        np_writer.write_plan(str(root), plan, sources, "bf16", 4096)


def test_np_writer_declines_other_shard_dims_up_front(tmp_path):
    local = synthetic_checkpoint(tmp_path / "ckpt", world_size=2, config=tiny_llama_config())
    index = pt_index.open_index(str(local))
    sources = dict(index.tensors)
    name = next(n for n, s in sources.items() if len(s.shape) == 2)
    sources[name] = type(sources[name])(**{**sources[name].__dict__, "shard_dim": 1})
    with pytest.raises(np_writer.Declined, match="dim 1"):
        np_writer.check(sources, "bf16")


def test_np_writer_imports_no_torch(tmp_path):
    local = synthetic_checkpoint(tmp_path / "ckpt", world_size=2, config=tiny_llama_config())
    code = f"""
import sys
from slimckpt.format import layout
from slimckpt.write import np_writer
from slimckpt.read import pt_index
from slimckpt.write.out_files import create_files
index = pt_index.open_index({str(local)!r})
specs = [layout.TensorSpec(n, "BF16", t.shape) for n, t in index.tensors.items()]
plan = layout.plan_files(specs, "50GB")
create_files({str(tmp_path)!r}, plan)
np_writer.write_plan({str(tmp_path)!r}, plan, dict(index.tensors), "bf16", 4096)
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# In the merge: the child forked before torch is imported
def _merge(local, target, **kw):
    return merge.merge(merge.MergeOptions(local_dir=str(local), target_dir=str(target), progress=False, **kw))


def _outputs(d):
    return {
        n: (d / n).read_bytes()
        for n in sorted(os.listdir(d))
        if n.endswith((".safetensors", ".json")) and n != "manifest.json"
    }


@pytest.fixture
def without_torch(monkeypatch):
    """The merge as `slimckpt merge` runs it: torch not imported yet, fork allowed; counts the forks."""
    from slimckpt.write import forked_call

    made = []
    real = forked_call.ForkedCall

    class Counting(real):
        def __init__(self, fn, *a, **k):
            made.append(fn.__name__)
            super().__init__(fn, *a, **k)

    monkeypatch.setattr(forked_call, "ForkedCall", Counting)
    monkeypatch.setattr(forked_call, "possible", lambda: True)  # pytest's own threads would say no
    monkeypatch.setattr(early_write, "_torch_imported", lambda: False)
    return made


def test_the_merge_writes_before_torch_the_same_bytes(tmp_path, monkeypatch, without_torch):
    local = synthetic_checkpoint(tmp_path / "actor", world_size=2, config=tiny_llama_config(tie_word_embeddings=True))
    _merge(local, tmp_path / "early")
    assert without_torch == ["_write_weights_without_torch"]
    monkeypatch.setenv("SLIMCKPT_MERGE_GUESS", "0")
    _merge(local, tmp_path / "planned")
    assert _outputs(tmp_path / "early") == _outputs(tmp_path / "planned")
    assert (
        json.loads((tmp_path / "early" / "manifest.json").read_text())["files"]
        == json.loads((tmp_path / "planned" / "manifest.json").read_text())["files"]
    )


def test_the_writers_timings_are_written_when_asked(tmp_path, monkeypatch, without_torch):
    """SLIMCKPT_MERGE_STATS=FILE: the forked writer's timings, with every tensor byte read once
    per rank copy (world size 2: the replicated norms twice)."""
    local = synthetic_checkpoint(tmp_path / "actor", world_size=2, config=tiny_llama_config())
    index = pt_index.open_index(str(local))
    expected = sum(math.prod(p.shape) * t.itemsize for t in index.tensors.values() for p in t.pieces)
    stats_file = tmp_path / "stats.json"
    monkeypatch.setenv(writer_stats.STATS_ENV, str(stats_file))
    _merge(local, tmp_path / "out")
    assert without_torch == ["_write_weights_without_torch"]
    stats = writer_stats.WriterStats.load(str(stats_file))
    assert stats.read_bytes == expected and stats.read_threads >= 1
    assert 0 < stats.read_s <= stats.wall_s * stats.read_threads
    assert 0 < stats.cast_s < stats.wall_s and 0 <= stats.wait_read_s < stats.wall_s and stats.close_s > 0
    assert 0 < stats.read_busy() <= 1


def test_no_timings_file_unless_asked(tmp_path, monkeypatch, without_torch):
    monkeypatch.delenv(writer_stats.STATS_ENV, raising=False)
    local = synthetic_checkpoint(tmp_path / "actor", world_size=1, config=tiny_llama_config())
    _merge(local, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor", "out"]


def test_a_nan_leaves_the_weights_to_torch(tmp_path, monkeypatch, without_torch):
    def nan(rank, sd):
        sd["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")

    # one rank: with two, the torch writer refuses the copies (NaN != NaN), as verl's merger does
    local = synthetic_checkpoint(tmp_path / "actor", world_size=1, per_rank_edit=nan)
    with lines_of(merge.log) as logged:
        _merge(local, tmp_path / "early")
    assert "left the weights to torch" in logged.getvalue() and "NaN" in logged.getvalue()
    monkeypatch.setenv("SLIMCKPT_MERGE_GUESS", "0")
    _merge(local, tmp_path / "planned")
    assert _outputs(tmp_path / "early") == _outputs(tmp_path / "planned")


def test_differing_copies_get_the_torch_writers_error(tmp_path, without_torch):
    def edit(rank, sd):
        if rank == 1:
            sd["model.layers.0.mlp.up_proj.weight"][3, 5] += 1

    local = synthetic_checkpoint(tmp_path / "actor", world_size=2, per_rank_edit=edit)
    with pytest.raises(merge.MergeError, match=r"rank_1\.pt: unsharded entry .*differs"):
        _merge(local, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_full_disk_in_the_child_before_torch_is_the_users_error(tmp_path, monkeypatch, without_torch):
    local = synthetic_checkpoint(tmp_path / "actor", world_size=2)
    full_disk_after_headers(monkeypatch)
    with pytest.raises(merge.MergeError, match=r"model.*safetensors.*(space|full)"):
        _merge(local, tmp_path / "out")
    assert without_torch == ["_write_weights_without_torch"]
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_the_cli_writes_before_importing_torch(tmp_path):
    local = synthetic_checkpoint(tmp_path / "actor", world_size=2)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimckpt.cli",
            "merge",
            "--local_dir",
            str(local),
            "--target_dir",
            str(tmp_path / "cli"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SLIMCKPT_LOG_LEVEL": "DEBUG"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "forked before torch is imported" in proc.stderr
    os.environ["SLIMCKPT_MERGE_GUESS"] = "0"
    try:
        _merge(local, tmp_path / "planned")
    finally:
        del os.environ["SLIMCKPT_MERGE_GUESS"]
    assert _outputs(tmp_path / "cli") == _outputs(tmp_path / "planned")


def _session_alive(sid: int) -> list[int]:
    """Pids of processes still in session `sid` (a killed merge's forked writer, say).

    A process counts until every one of its threads has exited: a killed multi-threaded process
    shows its main thread as a zombie while its other threads (a write in flight) still exit, and
    they keep its open files, flocks included, until the last one is gone."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid:  # session id
                continue
            states = []
            for tid in os.listdir(f"/proc/{entry}/task"):
                with open(f"/proc/{entry}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            continue
        if any(state not in ("Z", "X") for state in states):  # zombies are waited for by their parent
            alive.append(int(entry))
    return alive


@pytest.mark.slow
@pytest.mark.parametrize("who", ["merge process", "process group"])
def test_a_killed_cli_merge_never_looks_complete_and_reruns(tmp_path, who):
    """SIGKILL at random moments of `slimckpt merge` (its writer forked before torch): the target
    is absent or complete and verifying, the writer dies with its parent, and a rerun succeeds."""
    import random
    import signal
    import time

    from slimckpt.format.merge_manifest import verify

    from ..helpers.merge_helpers import run_cli

    # 29M parameters: the writer child, which starts a few tenths of a second in, works long enough
    # for the early kills to land in it (the later ones land in the imports and the commit)
    local = synthetic_checkpoint(
        tmp_path / "actor",
        world_size=2,
        config=tiny_llama_config(hidden_size=512, intermediate_size=1376, vocab_size=16000, num_hidden_layers=4),
    )
    t0 = time.monotonic()
    assert run_cli(["merge", "--local_dir", str(local), "--target_dir", str(tmp_path / "ref")]).returncode == 0
    wall = time.monotonic() - t0
    rng = random.Random(who)
    outcomes = []
    for trial, (lo, hi) in enumerate([(0.2, 0.7), (0.7, 1.5), (0.05, wall)]):
        target = tmp_path / f"t{trial}"
        cmd = [sys.executable, "-m", "slimckpt.cli", "merge", "--local_dir", str(local), "--target_dir", str(target)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(rng.uniform(lo, hi))
        if who == "merge process":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while _session_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _session_alive(proc.pid), "the merge's writer outlived it"
        if target.exists():
            assert verify(str(target)) == [], f"trial {trial}: {target} looks complete but does not verify"
            outcomes.append("complete")
        else:
            outcomes.append("none")
        rerun = run_cli(["merge", "--local_dir", str(local), "--target_dir", str(target), "--overwrite"])
        assert rerun.returncode == 0, rerun.stderr[-2000:]
        assert _outputs(target) == _outputs(tmp_path / "ref")
    print(who, outcomes)
