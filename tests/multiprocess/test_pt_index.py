"""slimckpt.read.pt_index: byte locations of a verl checkpoint's tensors read without torch, equal to what
the real reader (torch.load mmap) makes of the same files, or None; never a different reading."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile

import pytest
import torch

from slimckpt.observe.memory import rss_anon_bytes
from slimckpt.read import pt_index, pt_tensors
from slimckpt.read.sources import open_checkpoint, open_indexed, signature

from ..conftest import run_python
from ..helpers.merge_helpers import fsdp_checkpoint, synthetic_checkpoint
from .test_merge_verl import CHECKPOINTS, SHARDED_TENSOR, checkpoint

SIMPLE = ("fsdp2_w2", "fsdp2_w3_uneven", "fsdp1_qwen2_tied")  # 1-D meshes: pt_index must read these


def _extras(rank: int, sd: dict) -> None:
    """Entries beyond a model's weights: other dtypes, a scalar, an empty tensor, two views of one storage."""
    base = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    sd.update(
        {
            "extra.bf16": torch.linspace(-3, 3, 40).to(torch.bfloat16).reshape(5, 8),
            "extra.fp16": torch.linspace(-1, 1, 6).to(torch.float16),
            "extra.int64": torch.arange(7, dtype=torch.int64) * (1 << 40),
            "extra.bool": torch.tensor([True, False, True]),
            "extra.scalar": torch.tensor(2.5),
            "extra.empty": torch.empty(0, 4),
            "extra.view_a": base[1:3],  # storage offset 4 elements
            "extra.view_b": base[3:],
        }
    )


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return synthetic_checkpoint(tmp_path_factory.mktemp("pt_index") / "actor", world_size=2, per_rank_edit=_extras)


def assert_reads_like_the_real_reader(local_dir) -> pt_index.IndexedCheckpoint:
    index = pt_index.open_index(str(local_dir))
    assert index is not None
    real = open_checkpoint(str(local_dir))
    assert (index.local_dir, index.world_size, index.fsdp_version) == (
        real.local_dir,
        real.world_size,
        real.fsdp_version,
    )
    assert list(index.tensors) == list(real.tensors)
    names = {k: k for k in real.tensors}
    assert pt_index.signature(index, names) == signature(real, names)
    renamed = {f"out.{k}": k for k in list(real.tensors)[::2]}
    assert pt_index.signature(index, renamed) == signature(real, renamed)
    for key, st in real.tensors.items():
        it = index.tensors[key]
        assert it.itemsize == st.pieces[0].element_size() and it.dtype == str(st.dtype)
        for k, (piece, stored) in enumerate(zip(st.pieces, it.pieces, strict=True)):
            assert stored.path == st.file_of(k)
            want = piece.reshape(-1).view(torch.uint8).numpy().tobytes()
            with open(stored.path, "rb") as f:
                got = os.pread(f.fileno(), len(want), stored.offset)
            assert got == want, (key, k)
    return index


def test_dtype_tables_are_torchs():
    """The dtype names and storage classes pt_index knows are spelled, sized and pickled as torch does."""
    from torch.storage import _dtype_to_storage_type_map

    for name, size in pt_index._ITEMSIZE.items():
        dtype = getattr(torch, name)
        assert str(dtype) == f"torch.{name}" and dtype.itemsize == size
        assert f"torch\n{name}\n".encode() in pickle.dumps(dtype, protocol=2)  # the GLOBAL opcode's text
    legacy = {v: str(k).removeprefix("torch.") for k, v in _dtype_to_storage_type_map().items()}
    for cls, name in pt_index._STORAGE_DTYPE.items():
        assert legacy[cls] == name


def test_plain_checkpoint(plain):
    index = assert_reads_like_the_real_reader(plain)
    t = index.tensors["model.embed_tokens.weight"]
    assert t.shard_dim is None and t.ranks == [0, 1] and len({p.path for p in t.pieces}) == 2
    assert index.tensors["extra.bf16"].dtype == "torch.bfloat16"
    a, b = index.tensors["extra.view_a"].pieces[0], index.tensors["extra.view_b"].pieces[0]
    assert b.offset - a.offset == 2 * 4 * 4  # two rows of four float32 further into the same storage
    assert pt_index.signature(index, {"e": "extra.empty"})[0][7][0][0] is None  # no bytes: no location


def _same(ours, theirs, where="") -> None:
    """ours == theirs, tensors by dtype, shape, stride, storage offset and bytes; the rest by value."""
    assert type(ours) is type(theirs), (where, type(ours), type(theirs))
    if isinstance(theirs, torch.Tensor):
        assert (ours.dtype, ours.shape, ours.stride(), ours.storage_offset(), ours.requires_grad) == (
            theirs.dtype,
            theirs.shape,
            theirs.stride(),
            theirs.storage_offset(),
            theirs.requires_grad,
        ), where
        assert torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), where
        for k in theirs:
            _same(ours[k], theirs[k], f"{where}.{k}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, where


def test_torch_side_reads_what_torch_load_reads_mapped(plain, tmp_path):
    """pt_tensors.load of a rank file and of other entries: torch.load's objects (mapped or read), views
    of one storage still one storage, every tensor a view of the file where the index's records say."""
    path = str(plain / "model_world_size_2_rank_0.pt")
    extra = {
        "legacy": torch.arange(6, dtype=torch.int32),
        "param": torch.nn.Parameter(torch.ones(3, 2)),
        "nested": [{"a": torch.zeros(2, 0)}, (1, "x")],
    }
    other = str(tmp_path / "other.pt")
    torch.save(extra, other)
    for p in (path, other):
        _same(pt_tensors.load(p), torch.load(p, mmap=True, weights_only=False, map_location="cpu"))
        _same(pt_tensors.load(p, access=None), torch.load(p, weights_only=False, map_location="cpu"))
    ours = pt_tensors.load(path)
    a, b = ours["extra.view_a"], ours["extra.view_b"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    files = pt_tensors.MappedFiles([path])
    records = dict(pt_index.tensor_records(pt_index.PtFile(path).state))
    assert list(records) == [(k,) for k in ours]
    for key, t in ours.items():
        assert records[(key,)].shape == tuple(t.shape) and records[(key,)].stride == t.stride()
        if t.numel():
            assert files.locate(t) == (path, records[(key,)].offset), key


def test_mapped_tensors_stay_out_of_anonymous_memory(tmp_path):
    """Reading every byte of a mapped file's tensors grows no anonymous memory (the merge's bounded-RSS
    figures depend on it); the same file read into memory does, by its size."""
    path = str(tmp_path / "big.pt")
    torch.save({"w": torch.ones(16 << 20, dtype=torch.float32)}, path)  # 64 MiB

    def growth(access) -> int:
        before = rss_anon_bytes()
        t = pt_tensors.load(path, access=access)["w"]
        assert int(t.view(torch.int32)[::1024].sum()) == int(torch.ones(1).view(torch.int32)) * (t.numel() // 1024)
        grown = rss_anon_bytes() - before
        del t
        return grown

    assert growth(pt_tensors.COPY) < 8 << 20
    assert growth(None) > 48 << 20


def test_open_indexed_is_the_full_readers_reading(plain):
    """The early writer's reader (the index's tensors, no torch.distributed unpickled) gives the full
    reader's tensors, byte for byte and location for location."""
    quick, real = open_indexed(str(plain)), open_checkpoint(str(plain))
    names = {k: k for k in real.tensors}
    assert signature(quick, names) == signature(real, names)
    for key, st in real.tensors.items():
        for p, q in zip(st.pieces, quick.tensors[key].pieces, strict=True):
            assert torch.equal(p, q) and p.stride() == q.stride(), key


@pytest.mark.parametrize("world_size", [1, 3])
def test_bf16_checkpoints(tmp_path, world_size):
    def to_bf16(rank, sd):
        sd.update({k: v.to(torch.bfloat16) for k, v in sd.items()})

    ckpt = synthetic_checkpoint(tmp_path / "actor", world_size=world_size, per_rank_edit=to_bf16)
    index = assert_reads_like_the_real_reader(ckpt)
    assert {t.dtype for t in index.tensors.values()} == {"torch.bfloat16"}
    assert all(t.ranks == list(range(world_size)) for t in index.tensors.values())


def _rewrite_zip(path, edit) -> None:
    """Write `path` again with Python's zipfile (no alignment padding); edit(name, data) -> (data, method)."""
    with zipfile.ZipFile(path) as z:
        items = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for name, data in items:
            data, method = edit(name, data)
            z.writestr(name, data, compress_type=method)


def test_a_zip_without_torchs_padding_is_read_at_its_own_offsets(plain, tmp_path):
    """Data offsets come from each entry's local header, whatever its extra field holds."""
    ckpt = shutil.copytree(plain, tmp_path / "actor")
    for r in range(2):
        _rewrite_zip(ckpt / f"model_world_size_2_rank_{r}.pt", lambda name, data: (data, zipfile.ZIP_STORED))
    assert_reads_like_the_real_reader(ckpt)


@pytest.mark.parametrize("header_read", [30, 40])
def test_local_headers_read_in_pieces_give_the_same_offsets(plain, monkeypatch, header_read):
    """One read usually holds a local header and its name; where it does not (a name past the read,
    or a header at the end of a file), the rest is read on its own."""
    monkeypatch.setattr(pt_index, "_HEADER_READ", header_read)
    assert_reads_like_the_real_reader(plain)


def _damage(ckpt, how: str) -> None:
    path = ckpt / "model_world_size_2_rank_1.pt"
    sd = torch.load(path, weights_only=True)
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "tail_cut":
        path.write_bytes(path.read_bytes()[:-40])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "text":
        path.write_text("not a checkpoint\n")
    elif how == "foreign_pickle":
        path.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    elif how == "list":
        torch.save(list(sd.values()), path)
    elif how == "bare_tensor":
        torch.save(sd["model.norm.weight"], path)
    elif how == "parameter":  # an unknown pickle global (torch._utils._rebuild_parameter)
        torch.save({**sd, "model.norm.weight": torch.nn.Parameter(sd["model.norm.weight"])}, path)
    elif how == "non_tensor_value":
        torch.save({**sd, "model.norm.weight": 3}, path)
    elif how == "non_contiguous":
        torch.save({**sd, "model.norm.weight": torch.stack([sd["model.norm.weight"]] * 2, 1)[:, 0]}, path)
    elif how == "keys_differ":
        sd.pop("lm_head.weight")
        torch.save(sd, path)
    elif how == "shapes_differ":
        torch.save({**sd, "model.norm.weight": sd["model.norm.weight"][:-1].clone()}, path)
    elif how == "legacy_format":
        torch.save(sd, path, _use_new_zipfile_serialization=False)
    elif how == "compressed":
        _rewrite_zip(path, lambda name, data: (data, zipfile.ZIP_DEFLATED))
    elif how == "short_storage":
        _rewrite_zip(path, lambda name, data: (data[:-4] if name.endswith("/data/0") else data, zipfile.ZIP_STORED))
    elif how == "big_endian":
        _rewrite_zip(path, lambda name, data: (b"big" if name.endswith("/byteorder") else data, zipfile.ZIP_STORED))
    elif how == "no_config":
        (ckpt / "fsdp_config.json").unlink()
    elif how == "missing_rank":
        path.unlink()
    else:
        raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    [
        "truncated",
        "tail_cut",
        "empty",
        "text",
        "foreign_pickle",
        "list",
        "bare_tensor",
        "parameter",
        "non_tensor_value",
        "non_contiguous",
        "keys_differ",
        "shapes_differ",
        "legacy_format",
        "compressed",
        "short_storage",
        "big_endian",
        "no_config",
        "missing_rank",
    ],
)
def test_not_the_simple_kind_is_none(plain, tmp_path, how):
    ckpt = shutil.copytree(plain, tmp_path / "actor")
    assert pt_index.open_index(str(ckpt)) is not None  # the copy itself is fine
    _damage(ckpt, how)
    assert pt_index.open_index(str(ckpt)) is None


def test_no_torch_imported(plain, tmp_path):
    """pt_index reads byte locations from the pickles alone: torch's side is pt_tensors, so neither
    torch nor numpy loads with it."""
    index = pt_index.open_index(str(plain))
    names = {k: k for k in index.tensors}
    code = (
        "import json, sys\n"
        "from slimckpt.read import pt_index\n"
        f"index = pt_index.open_index({str(plain)!r})\n"
        "sig = pt_index.signature(index, {k: k for k in index.tensors})\n"
        f"assert pt_index.open_index({str(tmp_path / 'nothing')!r}) is None\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\n"
        "print(json.dumps({'sig': sig, 'heavy': heavy}))\n"
    )
    proc = run_python(code, env={"PYTHONDONTWRITEBYTECODE": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["heavy"] == []
    assert out["sig"] == json.loads(json.dumps(pt_index.signature(index, names)))


@pytest.mark.slow
@pytest.mark.parametrize("name", [*CHECKPOINTS, SHARDED_TENSOR[0]])
def test_fsdp_checkpoints(tmp_path_factory, name):
    """Real verl checkpoints (torchrun): 1-D meshes (FSDP2 world sizes 2 and 3 with uneven shards, some on
    dim 1; FSDP1 with a mesh) read like the real reader; 2-D meshes and ShardedTensors give None."""
    if name == SHARDED_TENSOR[0]:
        ckpt = fsdp_checkpoint(tmp_path_factory, name, SHARDED_TENSOR[1], *SHARDED_TENSOR[2])
    else:
        ckpt = checkpoint(tmp_path_factory, name)
    index = pt_index.open_index(str(ckpt))
    assert (index is not None) == (name in SIMPLE)
    if index is None:
        return
    assert_reads_like_the_real_reader(ckpt)
    sharded = [t for t in index.tensors.values() if t.shard_dim is not None]
    assert sharded and all(t.ranks == list(range(index.world_size)) for t in sharded)
    if name == "fsdp2_w3_uneven":
        assert index.world_size == 3
        assert any(len({p.shape[t.shard_dim] for p in t.pieces}) > 1 for t in sharded)  # uneven last shard
        assert any(t.shard_dim == 1 for t in sharded)
