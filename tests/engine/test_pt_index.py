"""slimckpt.engine.pt_index, the one reader of `.pt` files: byte locations of every tensor read without
torch, equal to what torch.load (mmap) makes of the same files; a damaged file refused, never misread."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile

import pytest
import torch

from slimckpt.engine import pt_index, pt_tensors
from slimckpt.engine.verl_sources import open_checkpoint
from slimckpt.observe.memory import rss_anon_bytes

from ..conftest import run_python
from ..helpers.merge_helpers import fsdp_checkpoint, synthetic_checkpoint
from ..merge.test_verl_merger import CHECKPOINTS, SHARDED_TENSOR, checkpoint


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


def assert_reads_like_torch(local_dir) -> dict[str, dict[tuple, pt_index.TensorRecord]]:
    """Every rank file's tensor records: same keys, dtypes, shapes and strides as torch.load's tensors,
    and the bytes at each record's offset are that tensor's bytes."""
    out = {}
    for path in sorted(p for p in os.listdir(local_dir) if p.endswith(".pt")):
        full = os.path.join(str(local_dir), path)
        records = dict(pt_index.tensor_records(pt_index.PtFile(full).state))
        theirs = torch.load(full, mmap=True, weights_only=False, map_location="cpu")
        plain_keys = [k for k, v in theirs.items() if type(v) is torch.Tensor]
        assert plain_keys and all(records[(k,)] is not None for k in plain_keys)
        for key in plain_keys:
            t, rec = theirs[key], records[(key,)]
            assert (
                rec.shape == tuple(t.shape) and rec.stride == t.stride() and f"torch.{rec.dtype.name}" == str(t.dtype)
            )
            want = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            with open(full, "rb") as f:
                got = os.pread(f.fileno(), len(want), rec.offset) if want else b""
            assert got == want, (path, key)
        out[path] = records
    return out


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
    records = assert_reads_like_torch(plain)["model_world_size_2_rank_0.pt"]
    assert records[("extra.bf16",)].dtype.name == "bfloat16"
    a, b = records[("extra.view_a",)], records[("extra.view_b",)]
    assert b.offset - a.offset == 2 * 4 * 4  # two rows of four float32 further into the same storage
    assert a.storage is b.storage


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
    records = dict(pt_index.tensor_records(pt_index.PtFile(path).state))
    assert list(records) == [(k,) for k in ours]
    for key, t in ours.items():
        assert records[(key,)].shape == tuple(t.shape) and records[(key,)].stride == t.stride()


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


@pytest.mark.parametrize("world_size", [1, 3])
def test_bf16_checkpoints(tmp_path, world_size):
    def to_bf16(rank, sd):
        sd.update({k: v.to(torch.bfloat16) for k, v in sd.items()})

    ckpt = synthetic_checkpoint(tmp_path / "actor", world_size=world_size, per_rank_edit=to_bf16)
    files = assert_reads_like_torch(ckpt)
    assert len(files) == world_size
    assert {r.dtype.name for recs in files.values() for r in recs.values()} == {"bfloat16"}


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
    assert_reads_like_torch(ckpt)


@pytest.mark.parametrize("header_read", [30, 40])
def test_local_headers_read_in_pieces_give_the_same_offsets(plain, monkeypatch, header_read):
    """One read usually holds a local header and its name; where it does not (a name past the read,
    or a header at the end of a file), the rest is read on its own."""
    monkeypatch.setattr(pt_index, "_HEADER_READ", header_read)
    assert_reads_like_torch(plain)


def _damage(path, how: str) -> None:
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
    elif how == "legacy_format":
        torch.save(torch.load(path, weights_only=True), path, _use_new_zipfile_serialization=False)
    elif how == "compressed":
        _rewrite_zip(path, lambda name, data: (data, zipfile.ZIP_DEFLATED))
    elif how == "short_storage":
        _rewrite_zip(path, lambda name, data: (data[:-4] if name.endswith("/data/0") else data, zipfile.ZIP_STORED))
    elif how == "big_endian":
        _rewrite_zip(path, lambda name, data: (b"big" if name.endswith("/byteorder") else data, zipfile.ZIP_STORED))
    else:
        raise AssertionError(how)


DAMAGE = [
    "truncated",
    "tail_cut",
    "empty",
    "text",
    "foreign_pickle",
    "legacy_format",
    "compressed",
    "short_storage",
    "big_endian",
]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_file_is_refused_not_misread(plain, tmp_path, how):
    """What torch.save did not write as this reader reads it raises, naming why; no record is made up."""
    path = tmp_path / "rank.pt"
    shutil.copyfile(plain / "model_world_size_2_rank_1.pt", path)
    assert pt_index.PtFile(str(path)).state  # the copy itself is fine
    _damage(path, how)
    with pytest.raises((pt_index.NotATorchFile, pickle.UnpicklingError, EOFError, zipfile.BadZipFile, OSError)):
        pt_index.PtFile(str(path))


def test_no_torch_imported(plain):
    """pt_index reads byte locations from the pickles alone: torch's side is pt_tensors, so neither
    torch nor numpy loads with it."""
    path = str(plain / "model_world_size_2_rank_0.pt")
    want = {repr(k): r.offset for k, r in pt_index.tensor_records(pt_index.PtFile(path).state)}
    code = (
        "import json, sys\n"
        "from slimckpt.engine import pt_index\n"
        f"records = pt_index.tensor_records(pt_index.PtFile({path!r}).state)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\n"
        "print(json.dumps({'offsets': {repr(k): r.offset for k, r in records}, 'heavy': heavy}))\n"
    )
    # no torch to import here: the child ends in about a second; 120 s is a hang
    proc = run_python(code, env={"PYTHONDONTWRITEBYTECODE": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["heavy"] == []
    assert out["offsets"] == want


@pytest.mark.slow
@pytest.mark.parametrize("name", [*CHECKPOINTS, SHARDED_TENSOR[0]])
def test_fsdp_checkpoints(tmp_path_factory, name):
    """Real verl checkpoints (torchrun; FSDP2 at world sizes 2 and 3 with uneven shards, FSDP1 with and
    without a mesh, 2-D meshes): every local shard's record is where torch.load finds its bytes, and the
    checkpoint reader built on them opens it."""
    if name == SHARDED_TENSOR[0]:
        ckpt = fsdp_checkpoint(tmp_path_factory, name, SHARDED_TENSOR[1], *SHARDED_TENSOR[2])
    else:
        ckpt = checkpoint(tmp_path_factory, name)
    assert open_checkpoint(str(ckpt)).tensors
    if name == SHARDED_TENSOR[0]:
        return  # torch.load rebuilds a ShardedTensor only inside the saving ranks' process group
    compared = 0
    for path in sorted(p for p in os.listdir(ckpt) if p.endswith(".pt")):
        full = os.path.join(str(ckpt), path)
        ours, theirs = pt_tensors.load(full), torch.load(full, mmap=True, weights_only=False, map_location="cpu")
        assert list(ours) == list(theirs)
        for key, value in theirs.items():
            a, b = _local(ours[key]), _local(value)
            if b is None:
                continue
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (path, key)
            compared += 1
    assert compared


def _local(value):
    """A rank's own bytes of a state-dict value: a DTensor's local tensor or a plain tensor."""
    if hasattr(value, "to_local"):
        return value.to_local()
    return value if type(value) in (torch.Tensor, torch.nn.Parameter) else None
