"""The one reader of the `.pt` files slimckpt opens, without torch: where every tensor's bytes sit.

A `.pt` file is what `torch.save` writes: an uncompressed zip holding `<prefix>/data.pkl` (the
pickled object) and one entry `<prefix>/data/<key>` per storage. The pickle is read with
pickle_policy's `RestrictedUnpickler` (only the globals it allows are looked up); torch's rebuild
functions and classes are replaced by records of their arguments, and each storage entry's data
offset is read from its zip local header (what torch's mmap loader does too). So every tensor of a
file is listed (dtype, shape, stride, storage offset, the byte range in the file) before anything
is built; `pt_tensors` makes torch tensors from those offsets where torch is loaded (verl's rank
files, DCP's records, extra state, convert's own rank files), memory-mapped.

The merge's early writer starts from a quick index that skips the full reader's DTensor rebuild
(and its torch.distributed import): `open_index` indexes "the simple kind" of checkpoint:
every rank a dict with the same keys, every value a plain tensor (same shape everywhere) or a
DTensor on a 1-D mesh of ranks 0..W-1 with one Shard or Replicate placement. Anything else, or
anything this reader does not recognise or finds damaged, gives None: the full reader
(`sources.open_checkpoint`) decides and reports later. `signature` is the same list
`sources.signature` makes of the full reader's result, so the merge can compare the two and keep
early writes only when they read the same bytes.

No torch, no numpy (a test checks `sys.modules`): torch's side is `pt_tensors`.
"""

from __future__ import annotations

import collections
import io
import os
import struct
import sys
import zipfile
from dataclasses import dataclass, field

from ..format.names import TORCH_ITEMSIZE
from .checkpoint_dir import check_rank_files, read_fsdp_config
from .pickle_policy import RestrictedUnpickler

# torch's dtype globals as pickled (`torch float32`) -> itemsize; str(dtype) is "torch." + name
_ITEMSIZE: dict[str, int] = TORCH_ITEMSIZE
# the legacy storage classes torch.save names for the older dtypes (newer ones: UntypedStorage + dtype)
_STORAGE_DTYPE: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header, 30 bytes
_MAX_MESH_RANKS = 1 << 16
_HEADER_READ = 4096  # bytes read from each local header (see _data_offset)


@dataclass(frozen=True)
class StoredPiece:
    """One rank's tensor (or shard): element 0 at byte `offset` of `path`, C-contiguous."""

    path: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class IndexedTensor:
    """One state-dict entry, laid out as `sources.SourceTensor` would be (same pieces and ranks)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # as torch prints it: "torch.float32"
    itemsize: int
    shard_dim: int | None
    ranks: list[int]
    replicated_dtensor: bool
    pieces: list[StoredPiece]


@dataclass
class IndexedCheckpoint:
    """What `open_index` found: the tensors in the state dict's order, paths under `local_dir` (absolute)."""

    local_dir: str
    world_size: int
    fsdp_version: int | None
    tensors: dict[str, IndexedTensor] = field(repr=False)


class NotATorchFile(ValueError):
    """A file torch.save did not write, or not as this reader reads it; the message says what."""


class _NotSimple(NotATorchFile):
    """Not the simple kind, or not what torch.save writes: open_index returns None (the full reader
    names it in its error)."""


# --- what the pickle rebuilds, as plain records ---


@dataclass(frozen=True)
class _Dtype:
    name: str  # "float32"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.name]


@dataclass(frozen=True)
class _StorageType:
    dtype: _Dtype | None  # None: UntypedStorage (bytes; the tensor names its dtype)


class StorageRecord:
    def __init__(self, key: str, dtype: _Dtype | None, nbytes: int) -> None:
        self.key, self.dtype, self.nbytes = key, dtype, nbytes
        self.data_offset = -1  # set once the zip entry is found


class TensorRecord:
    """A plain tensor as `_rebuild_tensor_v2/v3` would make it."""

    def __init__(self, storage: StorageRecord, dtype: _Dtype, storage_offset: int, shape: tuple, stride: tuple) -> None:
        self.storage, self.dtype, self.storage_offset = storage, dtype, storage_offset
        self.shape, self.stride = shape, stride

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def offset(self) -> int:
        return self.storage.data_offset + self.storage_offset * self.dtype.itemsize


class Stub:
    """Stand-in for any torch.distributed class: keeps constructor arguments and pickled state."""

    qualname = "?"

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.args, obj.state = args, dict(kwargs)
        return obj

    def __init__(self, *args, **kwargs) -> None:
        pass  # __new__ kept them (pickle's REDUCE calls the class, NEWOBJ only __new__)

    def __setstate__(self, state) -> None:
        for part in state if isinstance(state, tuple) else (state,):
            if isinstance(part, dict):
                self.state.update(part)


class DTensorStub(Stub):
    qualname = "DTensor"
    shape: tuple = ()
    rebuilt = False  # made by _rebuild_wrapper_subclass (so `shape` is the pickled global shape)


def _ints(value, what: str) -> tuple[int, ...]:
    out = tuple(value)
    if any(type(x) is not int or x < 0 for x in out):
        raise _NotSimple(what)
    return out


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    # torch's is_contiguous: size-1 dims may have any stride, an empty tensor always is
    if len(shape) != len(stride):
        return False
    if 0 in shape:
        return True
    expect = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1:
            if st != expect:
                return False
            expect *= size
    return True


def _tensor(storage, storage_offset, size, stride, dtype: _Dtype) -> TensorRecord:
    if not isinstance(storage, StorageRecord) or type(storage_offset) is not int or storage_offset < 0:
        raise _NotSimple("storage")
    shape, strides = _ints(size, "size"), _ints(stride, "stride")
    if not _contiguous(shape, strides):
        raise _NotSimple("a non-contiguous tensor")
    t = TensorRecord(storage, dtype, storage_offset, shape, strides)
    if (storage_offset + t.numel) * dtype.itemsize > storage.nbytes:
        raise _NotSimple("a tensor past the end of its storage")
    return t


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    if not isinstance(storage, StorageRecord) or storage.dtype is None or backward_hooks or metadata:
        raise _NotSimple("tensor")
    return _tensor(storage, storage_offset, size, stride, storage.dtype)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    if (
        not isinstance(storage, StorageRecord)
        or storage.dtype is not None
        or not isinstance(dtype, _Dtype)
        or backward_hooks
        or metadata
    ):
        raise _NotSimple("tensor")
    return _tensor(storage, storage_offset, size, stride, dtype)


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
    if cls is not DTensorStub or layout != "torch.strided":
        raise _NotSimple("wrapper subclass")
    obj = DTensorStub()
    obj.shape, obj.rebuilt = _ints(size, "size"), True
    return obj


def _rebuild_from_type_v2(func, new_type, args, state):
    if func is not _rebuild_wrapper_subclass or new_type is not DTensorStub:
        raise _NotSimple("tensor subclass")
    obj = func(*args)
    obj.__setstate__(state)
    return obj


_DTYPES = {name: _Dtype(name) for name in _ITEMSIZE}
_GLOBALS: dict[tuple[str, str], object] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch.serialization", "_get_layout"): str,  # _get_layout("torch.strided"): kept as the name
    ("torch", "device"): lambda *args: ("device", *args),
    ("torch", "Size"): tuple,
    ("torch", "UntypedStorage"): _StorageType(None),
    **{("torch", name): _StorageType(_DTYPES[dt]) for name, dt in _STORAGE_DTYPE.items()},
    **{("torch", name): dt for name, dt in _DTYPES.items()},
}
STORAGE_TYPES: dict[str, _StorageType] = {
    "UntypedStorage": _StorageType(None),
    **{name: _StorageType(_DTYPES[dt]) for name, dt in _STORAGE_DTYPE.items()},
}
_STUBS: dict[tuple[str, str], type] = {}


class RecordUnpickler(RestrictedUnpickler):
    """A `.pt` file's data.pkl read into records: tensors as `TensorRecord`, every torch.distributed class
    as a `Stub` of its pickled state; each storage's data offset in the file is found as it is named.
    `pt_tensors.TorchUnpickler` resolves the same pickle to torch's objects instead."""

    def __init__(self, file, path: str, records: ZipRecords) -> None:
        super().__init__(file)
        self.path, self.records = path, records
        self.storages: dict[str, StorageRecord] = {}

    def resolve(self, module: str, name: str):
        known = _GLOBALS.get((module, name))
        if known is not None:
            return known
        if module == "torch.distributed" or module.startswith("torch.distributed."):
            if name == "DTensor":
                return DTensorStub
            key = (module, name)
            if key not in _STUBS:
                _STUBS[key] = type(name, (Stub,), {"qualname": name})
            return _STUBS[key]
        raise _NotSimple(f"pickle global {module}.{name}")

    def persistent_load(self, pid):
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] not in ("storage", b"storage"):
            raise _NotSimple("persistent id")
        _, stype, key, _location, numel = pid
        if not isinstance(stype, _StorageType) or type(key) is not str or type(numel) is not int or numel < 0:
            raise _NotSimple("storage id")
        nbytes = numel * (stype.dtype.itemsize if stype.dtype else 1)
        st = self.storages.get(key)
        if st is None:
            st = self.storages[key] = StorageRecord(key, stype.dtype, nbytes)
            st.data_offset = self.records.storage_offset(key, nbytes)
        elif st.nbytes != nbytes or st.dtype != stype.dtype:
            raise _NotSimple("one storage named with two sizes")
        return st


# --- one file ---


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a file of their own (one DCP record)."""

    def __init__(self, f, offset: int, length: int) -> None:
        super().__init__()
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        return self.pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(buf)[:n])
        self.pos += got
        return got


def _pread(f, n: int, offset: int) -> bytes:
    try:
        fd = f.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):  # an in-memory file
        f.seek(offset)
        return f.read(n)
    return os.pread(fd, n, offset)


class ZipRecords:
    """The entries of a torch.save zip at bytes [base, base + length) of the open file `f` (a whole
    `.pt` file, or one record of a DCP `.distcp` file): names, stored bytes, sizes, data offsets, read
    with Python's zipfile. torch's own reader (torch._C.PyTorchFileReader) is private and differs
    between the releases slimckpt runs on: torch 2.11's has no get_record_size."""

    def __init__(self, f, base: int = 0, length: int | None = None) -> None:
        self.f, self.base = f, base
        if base == 0 and length is None:
            self.zip = zipfile.ZipFile(f)
        else:
            end = length if length is not None else os.fstat(f.fileno()).st_size - base
            self.zip = zipfile.ZipFile(_Window(f, base, end))
        self.infos = {i.filename: i for i in self.zip.infolist()}
        if not self.infos:
            raise _NotSimple("an empty zip archive")
        self.prefix = next(iter(self.infos)).split("/")[0]  # torch names records after the first one's prefix

    def get_all_records(self) -> list[str]:
        return list(self.infos)

    def has_record(self, name: str) -> bool:
        return name in self.infos

    def get_record(self, name: str) -> bytes:
        """The entry's stored bytes, unchecked as torch's reader leaves them (a damaged record is a
        checksum's to find; a planted pickle global is pickle_policy's to refuse)."""
        info = _stored(self.infos[name])
        data = _pread(self.f, info.file_size, self.base + self.get_record_offset(name))
        if len(data) != info.file_size:
            raise _NotSimple(f"record {name} is cut short")
        return data

    def get_record_size(self, name: str) -> int:
        return self.infos[name].file_size

    def get_record_offset(self, name: str) -> int:
        """Where the entry's bytes start in the zip: after its LOCAL header, whose extra field (torch
        pads it to align the data) need not match the central directory's."""
        info = _stored(self.infos[name])
        # One read of _HEADER_READ bytes, not of the header alone: torch's reader, which the merge runs
        # later as a check while the early writer streams the same files, reads that much from each local
        # header. Read now, before the stream starts, those pages are in the page cache then, and the check
        # does not wait behind the writer's reads (measured: BENCHMARKS.md, Figures quoted in the code).
        at = self.base + info.header_offset
        block = _pread(self.f, _HEADER_READ, at)
        if len(block) < _LOCAL_HEADER.size:
            raise _NotSimple(f"record {name}: short local header")
        magic, *_, name_len, extra_len = _LOCAL_HEADER.unpack_from(block)
        stored_name = block[_LOCAL_HEADER.size : _LOCAL_HEADER.size + name_len]
        if len(stored_name) < name_len:
            stored_name += _pread(self.f, name_len - len(stored_name), at + len(block))
        if magic != b"PK\x03\x04" or stored_name != info.orig_filename.encode("utf-8"):
            raise _NotSimple(f"record {name}: local header does not match the central directory")
        return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len

    def read_at(self, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of the file."""
        data = _pread(self.f, n, offset)
        if len(data) != n:
            raise _NotSimple(f"the file ends before byte {offset + n}")
        return data

    def storage_offset(self, key: str, nbytes: int) -> int:
        """Where storage `key` (of `nbytes`) starts in the file."""
        name = f"{self.prefix}/data/{key}"
        info = self.infos.get(name)
        if info is None or _stored(info).file_size != nbytes:
            raise _NotSimple(f"storage {key}: missing or of another size")
        return self.base + self.get_record_offset(name)

    def pickle(self) -> bytes:
        """data.pkl's bytes, once the archive is one torch wrote in this host's byte order."""
        order = self.infos.get(f"{self.prefix}/byteorder")
        if order is not None and (_stored(order).file_size > 16 or self.get_record(order.filename) != b"little"):
            raise _NotSimple("a big-endian file")
        if sys.byteorder != "little":
            raise _NotSimple("a big-endian host")
        pkl = self.infos.get(f"{self.prefix}/data.pkl")
        if pkl is None:
            raise _NotSimple("no data.pkl")
        return self.get_record(pkl.filename)


def _stored(info: zipfile.ZipInfo) -> zipfile.ZipInfo:
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1 or info.compress_size != info.file_size:
        raise _NotSimple(f"{info.filename}: compressed or encrypted")
    return info


class PtFile:
    """One `.pt` file read by `unpickler` (records: no torch): `state`, what it holds, and `storages`,
    each with its data offset in the file. `base`/`length`: a torch.save zip inside a larger file."""

    def __init__(
        self,
        path: str,
        unpickler: type[RecordUnpickler] = RecordUnpickler,
        base: int = 0,
        length: int | None = None,
        **unpickler_args,
    ) -> None:
        self.path = path
        self.world = 0  # the checkpoint's world size, where open_index reads it
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            records = ZipRecords(f, base, length)
            reader = unpickler(io.BytesIO(records.pickle()), path, records, **unpickler_args)
            self.state = reader.load()
        self.storages = reader.storages
        for st in self.storages.values():
            if st.data_offset + st.nbytes > size:
                raise _NotSimple(f"storage {st.key} runs past the end of the file")

    def int_values(self, t: TensorRecord) -> list[int]:
        """The values of a small 1-D int tensor (a device mesh's ranks)."""
        fmt = {"int32": "i", "int64": "q"}.get(t.dtype.name)
        if fmt is None or len(t.shape) != 1 or t.shape[0] > _MAX_MESH_RANKS:
            raise _NotSimple("mesh tensor")
        n = t.shape[0]
        with open(self.path, "rb") as f:
            data = os.pread(f.fileno(), n * t.dtype.itemsize, t.offset)
        if len(data) != n * t.dtype.itemsize:
            raise _NotSimple("short read")
        return list(struct.unpack(f"<{n}{fmt}", data))


def tensor_records(obj, where: tuple = ()) -> list[tuple[tuple, TensorRecord]]:
    """Every tensor record of a PtFile's `state` (in dicts, lists, tuples and stubs' state), with the
    keys that lead to it: the list of what a file holds, with each tensor's bytes."""
    out: list[tuple[tuple, TensorRecord]] = []
    if isinstance(obj, TensorRecord):
        out.append((where, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out += tensor_records(v, (*where, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += tensor_records(v, (*where, i))
    elif isinstance(obj, Stub):
        for k, v in obj.state.items():
            out += tensor_records(v, (*where, k))
    return out


# --- the checkpoint ---


def open_index(local_dir: str) -> IndexedCheckpoint | None:
    """Every tensor's byte locations, when `local_dir` is the simple kind of checkpoint; else None
    (never raises for a bad checkpoint: the real reader reports what is wrong)."""
    local_dir = os.path.abspath(local_dir)
    try:
        return _open(local_dir)
    except Exception:  # noqa: BLE001 - not the simple kind, or damaged
        return None


def _open(local_dir: str) -> IndexedCheckpoint:
    world, version = read_fsdp_config(local_dir)
    paths = check_rank_files(local_dir, world)
    if len({os.path.realpath(p) for p in paths}) != len(paths):
        raise _NotSimple("two rank files are one file")  # the real reader's locations would name only one
    files = [PtFile(p) for p in paths]
    for f in files:
        f.world = world
    sds = [f.state for f in files]
    if not all(isinstance(sd, dict) and sd for sd in sds) or any(set(sd) != set(sds[0]) for sd in sds[1:]):
        raise _NotSimple("state dicts")
    tensors: dict[str, IndexedTensor] = {}
    meshes_ok: dict[int, bool] = {}
    for key in sds[0]:
        if type(key) is not str:
            raise _NotSimple("key")
        tensors[key] = _indexed(key, [sd[key] for sd in sds], files, meshes_ok)
    return IndexedCheckpoint(local_dir=local_dir, world_size=world, fsdp_version=version, tensors=tensors)


def _indexed(key: str, values: list, files: list[PtFile], meshes_ok: dict[int, bool]) -> IndexedTensor:
    world = len(files)
    v0 = values[0]
    if type(v0) is TensorRecord:  # plain: every rank's copy, compared as verl does
        if any(type(v) is not TensorRecord or v.shape != v0.shape for v in values):
            raise _NotSimple(key)
        return _made(key, v0.shape, None, values, files, list(range(world)), False)
    if type(v0) is not DTensorStub:
        raise _NotSimple(key)
    kinds = []
    for r, v in enumerate(values):
        if type(v) is not DTensorStub or v.shape != v0.shape:
            raise _NotSimple(key)
        kinds.append(_placement(v, r, files[r], meshes_ok))
    if len(set(kinds)) != 1:
        raise _NotSimple(key)
    kind, dim = kinds[0]
    shape = v0.shape
    locals_ = [v.state.get("_local_tensor") for v in values]
    if any(type(t) is not TensorRecord for t in locals_):
        raise _NotSimple(key)
    if kind == "Replicate":
        if locals_[0].shape != shape:
            raise _NotSimple(key)
        return _made(key, shape, None, locals_[:1], files[:1], [0], True)
    dim = dim + len(shape) if dim < 0 else dim
    if not 0 <= dim < len(shape):
        raise _NotSimple(key)
    rest = shape[:dim] + shape[dim + 1 :]
    if (
        any(len(t.shape) != len(shape) or t.shape[:dim] + t.shape[dim + 1 :] != rest for t in locals_)
        or sum(t.shape[dim] for t in locals_) != shape[dim]
    ):
        raise _NotSimple(key)
    return _made(key, shape, dim, locals_, files, list(range(world)), False)


def _made(
    key: str,
    shape: tuple,
    dim: int | None,
    pieces: list[TensorRecord],
    files: list[PtFile],
    ranks: list[int],
    replicated: bool,
) -> IndexedTensor:
    dtype = pieces[0].dtype
    if any(p.dtype != dtype for p in pieces):
        raise _NotSimple(key)  # a piece's dtype is not kept per piece here
    stored = [StoredPiece(f.path, p.offset, p.shape, p.stride) for p, f in zip(pieces, files)]
    return IndexedTensor(key, shape, f"torch.{dtype.name}", dtype.itemsize, dim, ranks, replicated, stored)


def _placement(v: DTensorStub, rank: int, rf: PtFile, meshes_ok: dict[int, bool]) -> tuple[str, int | None]:
    spec = v.state.get("_spec")
    if not v.rebuilt or not isinstance(spec, Stub) or spec.qualname != "DTensorSpec":
        raise _NotSimple("spec")
    placements = spec.state.get("placements")
    mesh = spec.state.get("mesh")
    if not isinstance(placements, tuple) or len(placements) != 1 or not isinstance(mesh, Stub):
        raise _NotSimple("2-D mesh")  # and FSDP + TP: the real reader
    if id(mesh) not in meshes_ok:  # one mesh object per file, pickled once
        meshes_ok[id(mesh)] = _mesh_is_ranks(mesh, rank, rf)
    if not meshes_ok[id(mesh)]:
        raise _NotSimple("mesh")
    p = placements[0]
    kind = p.qualname if isinstance(p, Stub) else "?"
    if kind == "Replicate":
        return kind, None
    if kind == "Shard":
        dim = p.state.get("dim", p.args[0] if p.args else None)
        if type(dim) is int:
            return kind, dim
    raise _NotSimple(f"placement {kind}")  # Partial, _StridedShard...


def _mesh_is_ranks(mesh: Stub, rank: int, rf: PtFile) -> bool:
    """Whether `mesh` is [0, ..., W-1] and `rank` is at its position `rank`: the real reader takes
    shards in mesh order and plain tensors from the mesh's ranks, so only then do both read alike."""
    s = mesh.state
    coord = s.get("_coordinate_on_dim")
    if (
        not isinstance(coord, (tuple, list))
        or list(coord) != [rank]
        or s.get("_rank", rank) != rank
        or s.get("_root_mesh") is not None
    ):
        return False
    if isinstance(s.get("mesh"), TensorRecord):  # torch releases that pickle the mesh tensor itself
        return rf.int_values(s["mesh"]) == list(range(rf.world))
    # newer torch: ranks + a CuTe-style layout whose 1-D identity is (W,):(1,); torch 2.11 pickles
    # the _MeshLayout's shape and stride itself, torch 2.13 one axis (a _FlatLayout) of it
    layout, rank_map = s.get("_layout"), s.get("_rank_map")
    if not isinstance(rank_map, TensorRecord) or not isinstance(layout, Stub):
        return False
    axis = layout.state
    if "shape" not in axis:
        axes = layout.state.get("axes")
        if not isinstance(axes, tuple) or len(axes) != 1 or not isinstance(axes[0], Stub):
            return False
        axis = axes[0].state
    if axis.get("shape") != (rf.world,) or axis.get("stride") != (1,):
        return False
    return rf.int_values(rank_map) == list(range(rf.world))


def signature(index: IndexedCheckpoint, name_map: dict[str, str]) -> list[tuple]:
    """`sources.signature` of the same checkpoint read by the full reader, from the index alone."""
    out = []
    for new, old in name_map.items():
        t = index.tensors[old]
        pieces = tuple(((p.path, p.offset) if 0 not in p.shape else None, p.shape, p.stride, t.dtype) for p in t.pieces)
        out.append((new, old, t.shape, t.dtype, t.shard_dim, tuple(t.ranks), t.replicated_dtensor, pieces))
    return out
