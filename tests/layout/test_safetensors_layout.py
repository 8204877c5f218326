"""slimckpt.layout.safetensors_layout: pure planning checked against the libraries whose output it must reproduce."""

from __future__ import annotations

import json
import os
import random
import struct

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file

import slimckpt.layout.safetensors_layout as layout
from slimckpt.layout.safetensors_layout import LayoutError, TensorSpec

TORCH_TO_ST = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, TORCH_TO_ST[t.dtype], tuple(t.shape))


def write_from_plan(path: str, f: layout.FileLayout, tensors: dict[str, torch.Tensor]) -> None:
    with open(path, "wb") as out:
        out.truncate(f.size)
        out.seek(0)
        out.write(f.header)
        for p in f.placements:
            data = tensors[p.spec.name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            assert len(data) == p.end - p.begin
            out.seek(p.begin)
            out.write(data)


def random_tensors(seed: int) -> dict[str, torch.Tensor]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = {}
    dtypes = list(TORCH_TO_ST)
    for i in range(25):
        dtype = rng.choice(dtypes)
        shape = tuple(rng.randint(0 if i % 7 == 0 else 1, 5) for _ in range(rng.randint(0, 3)))
        base = torch.randint(0, 100, shape, generator=g)
        name = (
            rng.choice(["model.layers.", "lm_head.", "a.", "Z.", "model.embed_", "é."]) + f"{rng.randint(0, 30)}.w{i}"
        )
        out[name] = base.to(dtype)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_file_from_plan_is_byte_identical_to_safetensors(tmp_path, seed):
    tensors = random_tensors(seed)
    specs = [spec_of(n, t) for n, t in tensors.items()]
    f = layout.plan_file("model.safetensors", specs)
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    write_from_plan(str(ours), f, tensors)
    save_file(tensors, str(theirs), metadata={"format": "pt"})
    assert ours.read_bytes() == theirs.read_bytes()
    assert f.size == os.path.getsize(theirs)
    loaded = load_file(str(ours))
    for name, t in tensors.items():
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_header_without_metadata_and_padding():
    spec = TensorSpec("x", "F32", (2,))
    h = layout.header_bytes([(spec, 0, 8)], metadata=None)
    n = struct.unpack("<Q", h[:8])[0]
    assert n % 8 == 0 and len(h) == 8 + n
    assert json.loads(h[8:]) == {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    body = h[8:]
    assert len(body) - len(body.rstrip(b" ")) < 8  # padding only up to the next multiple of 8


@pytest.mark.parametrize("max_size", ["1KB", "3KB", "10KB", 2500, "1MB"])
def test_split_matches_huggingface_hub(max_size):
    g = torch.Generator().manual_seed(7)
    sizes = [int(x) for x in torch.randint(1, 1200, (40,), generator=g)]
    tensors = {f"t{i}": torch.zeros(s, dtype=torch.float32 if i % 3 else torch.bfloat16) for i, s in enumerate(sizes)}
    tensors["huge"] = torch.zeros(5000)
    tensors["after"] = torch.zeros(3)
    theirs = split_torch_state_dict_into_shards(tensors, max_shard_size=max_size)
    plan = layout.plan_files([spec_of(n, t) for n, t in tensors.items()], max_size)
    assert {f.name: sorted(p.spec.name for p in f.placements) for f in plan.files} == {
        k: sorted(v) for k, v in theirs.filename_to_tensors.items()
    }
    assert [f.name for f in plan.files] == list(theirs.filename_to_tensors)
    assert plan.total_size == theirs.metadata["total_size"]
    assert plan.weight_map == theirs.tensor_to_filename
    assert plan.is_sharded == theirs.is_sharded


def test_parse_size():
    assert layout.parse_size("5GB") == 5 * 10**9
    assert layout.parse_size(" 1.5mb ") == 1_500_000
    assert layout.parse_size(123) == 123
    for bad in ("5G", "GB", "x5GB"):
        with pytest.raises(LayoutError):
            layout.parse_size(bad)


def test_save_pretrained_files_and_index_match(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path, state_dict=dict(sd), max_shard_size="20KB")
    plan = layout.plan_files([spec_of(n, t) for n, t in sd.items()], "20KB")
    assert plan.is_sharded
    assert sorted(x for x in os.listdir(tmp_path) if x.endswith(".safetensors")) == sorted(f.name for f in plan.files)
    assert (tmp_path / layout.INDEX_NAME).read_text() == plan.index_json(model.num_parameters())
    for f in plan.files:
        ours = tmp_path / ("ours-" + f.name)
        write_from_plan(str(ours), f, sd)
        assert ours.read_bytes() == (tmp_path / f.name).read_bytes(), f.name


def test_single_file_has_no_index():
    plan = layout.plan_files([TensorSpec("a", "BF16", (4, 4))], "5GB")
    assert [f.name for f in plan.files] == ["model.safetensors"]
    assert plan.index() is None and plan.index_json(10) is None


def _cover(plan, shares):
    """bytes each worker writes, checked to tile every tensor exactly once."""
    seen = {name: [] for name in plan.placements}
    per_worker = []
    for share in shares:
        total = 0
        for seg in share:
            p = plan.placements[seg.name]
            b, e = p.rows_to_bytes(seg.row_start, seg.row_end)
            total += e - b
            seen[seg.name].append((seg.row_start, seg.row_end))
        per_worker.append(total)
    for name, ranges in seen.items():
        ranges.sort()
        rows = plan.placements[name].spec.rows
        assert ranges[0][0] == 0 and ranges[-1][1] == rows, name
        for (_a, b), (c, _d) in zip(ranges, ranges[1:]):
            assert b == c, (name, ranges)
    return per_worker


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64])
def test_partition_tiles_and_balances(n):
    specs = [TensorSpec(f"w{i}", "BF16", (97 + i, 33)) for i in range(20)]
    specs += [TensorSpec("scalar", "F32", ()), TensorSpec("empty", "F32", (0, 4)), TensorSpec("bias", "F32", (5,))]
    plan = layout.plan_files(specs, "40KB")
    shares = layout.partition(plan, n)
    assert shares == layout.partition(plan, n)  # deterministic
    assert len(shares) == n
    per_worker = _cover(plan, shares)
    total = sum(per_worker)
    assert total == plan.total_size
    max_row = max(s.row_bytes for s in specs)
    for w in per_worker:
        assert abs(w - total / n) <= max_row + 1


def test_partition_more_workers_than_rows():
    plan = layout.plan_files([TensorSpec("a", "F32", (2, 3))], "5GB")
    shares = layout.partition(plan, 5)
    assert _cover(plan, shares) and sum(len(s) for s in shares) == 2


def test_partition_files_deterministic():
    specs = [TensorSpec(f"w{i}", "F32", (100 * (i + 1),)) for i in range(6)]
    plan = layout.plan_files(specs, "1KB")
    out = layout.partition_files(plan, 2)
    assert sorted(sum(out, [])) == sorted(f.name for f in plan.files)
    assert out == layout.partition_files(plan, 2)


def test_source_ranges_uneven_shards():
    spec = TensorSpec("w", "F32", (5, 3))
    plan = layout.plan_files([spec], "5GB")
    p = plan.placements["w"]
    rr = layout.source_ranges(p, [2, 2, 1])
    assert [(r.source, r.local_start, r.local_end) for r in rr] == [(0, 0, 2), (1, 0, 2), (2, 0, 1)]
    assert rr[0].begin == p.begin and rr[-1].end == p.end
    assert all(a.end == b.begin for a, b in zip(rr, rr[1:]))
    # an empty shard (FSDP's chunking can leave the last rank with nothing) contributes nothing
    assert [r.source for r in layout.source_ranges(p, [3, 2, 0])] == [0, 1]
    # a sub-range of rows cuts the shards it spans
    rr = layout.source_ranges(p, [2, 2, 1], 1, 4)
    assert [(r.source, r.local_start, r.local_end) for r in rr] == [(0, 1, 2), (1, 0, 2)]
    assert rr[0].begin == p.begin + 12
    with pytest.raises(LayoutError):
        layout.source_ranges(p, [2, 2])


def test_bad_specs():
    with pytest.raises(LayoutError):
        TensorSpec("x", "F4", (2,))
    with pytest.raises(LayoutError):
        layout.plan_files([TensorSpec("x", "F32", (2,)), TensorSpec("x", "F32", (2,))], "5GB")


def test_take_describes_a_run_of_elements():
    whole = layout.Take("w", (4, 6))
    assert whole.whole and whole.span is None
    whole.check_source((4, 6))
    with pytest.raises(LayoutError):
        whole.check_source((4, 5))
    gate = layout.Take("w", (3, 6), (12, 30))  # the gate half of expert 1 of a [2, 6, 6]: rows 6..9 of its [12, 6] view
    assert not gate.whole and gate.span == (12, 30)
    gate.check_source((2, 6, 6))
    with pytest.raises(LayoutError, match="past"):
        gate.check_source((1, 6, 4))
    with pytest.raises(LayoutError, match="cannot be read as shape"):
        layout.Take("w", (3, 6), (12, 29))


@pytest.mark.parametrize("seed", range(5))
def test_take_ranges_cut_a_span_over_shards_as_the_elements_lie(seed):
    """Against brute force: a source of R rows x C elements cut into dim-0 shards (uneven, some empty),
    an output that is a run of its elements, and any sub-range of the output."""
    rng = random.Random(seed)
    rows, cols = rng.randint(1, 9), rng.randint(1, 7)
    cuts = sorted(rng.randint(0, rows) for _ in range(rng.randint(0, 3)))
    shard_rows = [b - a for a, b in zip([0, *cuts], [*cuts, rows])]
    total = rows * cols
    owner = [
        (k, i - sum(shard_rows[:k]) * cols)
        for k, n in enumerate(shard_rows)
        for i in range(sum(shard_rows[:k]) * cols, sum(shard_rows[: k + 1]) * cols)
    ]
    for _ in range(20):
        s = rng.randint(0, total)
        t = rng.randint(s, total)
        a = rng.randint(0, t - s)
        b = rng.randint(a, t - s)
        got = layout.take_ranges(s, [n * cols for n in shard_rows], a, b)
        flat = [(r.source, r.local_start + i, r.out_start + i) for r in got for i in range(r.local_end - r.local_start)]
        assert flat == [(*owner[s + j], j) for j in range(a, b)]
        assert all(r.local_end > r.local_start for r in got)
    with pytest.raises(LayoutError, match="past"):
        layout.take_ranges(total - 1, [n * cols for n in shard_rows], 0, 2)
