"""The one reader of the `.pt` files slimckpt opens, without torch: where every tensor's bytes sit.

A `.pt` file is what `torch.save` writes: an uncompressed zip holding `<prefix>/data.pkl` (the
pickled object) and one entry `<prefix>/data/<key>` per storage. The pickle is read with
pickle_policy's `RestrictedUnpickler` (only the globals it allows are looked up); torch's rebuild
functions and classes are replaced by records of their arguments, and each storage entry's data
offset is read from its zip local header (what torch's mmap loader does too). So every tensor of a
file is listed (dtype, shape, stride, storage offset, the byte range in the file) before anything
is built; `pt_tensors` makes torch tensors from those offsets where torch is loaded (verl's rank
files, DCP's records, extra state, convert's own rank files), memory-mapped.

No torch, no numpy (a test checks `sys.modules`): torch's side is `pt_tensors`.
"""

from __future__ import annotations

import collections
import io
import os
import struct
import sys
import zipfile
from dataclasses import dataclass

from slimckpt import SlimckptError
from slimckpt.engine.pickle_policy import RestrictedUnpickler
from slimckpt.layout.names import TORCH_ITEMSIZE

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
_HEADER_READ = 4096  # bytes read at each local header (see get_record_offset)


class NotATorchFile(SlimckptError, ValueError):
    """A file torch.save did not write, or not as this reader reads it; the message says what."""


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


def _ints(value, what: str) -> tuple[int, ...]:
    out = tuple(value)
    if any(type(x) is not int or x < 0 for x in out):
        raise NotATorchFile(what)
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
        raise NotATorchFile("storage")
    shape, strides = _ints(size, "size"), _ints(stride, "stride")
    if not _contiguous(shape, strides):
        raise NotATorchFile("a non-contiguous tensor")
    t = TensorRecord(storage, dtype, storage_offset, shape, strides)
    if (storage_offset + t.numel) * dtype.itemsize > storage.nbytes:
        raise NotATorchFile("a tensor past the end of its storage")
    return t


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    if not isinstance(storage, StorageRecord) or storage.dtype is None or backward_hooks or metadata:
        raise NotATorchFile("tensor")
    return _tensor(storage, storage_offset, size, stride, storage.dtype)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    if (
        not isinstance(storage, StorageRecord)
        or storage.dtype is not None
        or not isinstance(dtype, _Dtype)
        or backward_hooks
        or metadata
    ):
        raise NotATorchFile("tensor")
    return _tensor(storage, storage_offset, size, stride, dtype)


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
    if cls is not DTensorStub or layout != "torch.strided":
        raise NotATorchFile("wrapper subclass")
    obj = DTensorStub()
    obj.shape = _ints(size, "size")
    return obj


def _rebuild_from_type_v2(func, new_type, args, state):
    if func is not _rebuild_wrapper_subclass or new_type is not DTensorStub:
        raise NotATorchFile("tensor subclass")
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
        raise NotATorchFile(f"pickle global {module}.{name}")

    def persistent_load(self, pid):
        if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] not in ("storage", b"storage"):
            raise NotATorchFile("persistent id")
        _, stype, key, _location, numel = pid
        if not isinstance(stype, _StorageType) or type(key) is not str or type(numel) is not int or numel < 0:
            raise NotATorchFile("storage id")
        nbytes = numel * (stype.dtype.itemsize if stype.dtype else 1)
        st = self.storages.get(key)
        if st is None:
            st = self.storages[key] = StorageRecord(key, stype.dtype, nbytes)
            st.data_offset = self.records.storage_offset(key, nbytes)
        elif st.nbytes != nbytes or st.dtype != stype.dtype:
            raise NotATorchFile("one storage named with two sizes")
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
            raise NotATorchFile("an empty zip archive")
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
            raise NotATorchFile(f"record {name} is cut short")
        return data

    def get_record_size(self, name: str) -> int:
        return self.infos[name].file_size

    def get_record_offset(self, name: str) -> int:
        """Where the entry's bytes start in the zip: after its LOCAL header, whose extra field (torch
        pads it to align the data) need not match the central directory's."""
        info = _stored(self.infos[name])
        # one read of a page covers the header and its name (the kernel reads no less from disk)
        at = self.base + info.header_offset
        block = _pread(self.f, _HEADER_READ, at)
        if len(block) < _LOCAL_HEADER.size:
            raise NotATorchFile(f"record {name}: short local header")
        magic, *_, name_len, extra_len = _LOCAL_HEADER.unpack_from(block)
        stored_name = block[_LOCAL_HEADER.size : _LOCAL_HEADER.size + name_len]
        if len(stored_name) < name_len:
            stored_name += _pread(self.f, name_len - len(stored_name), at + len(block))
        if magic != b"PK\x03\x04" or stored_name != info.orig_filename.encode("utf-8"):
            raise NotATorchFile(f"record {name}: local header does not match the central directory")
        return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len

    def read_at(self, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of the file."""
        data = _pread(self.f, n, offset)
        if len(data) != n:
            raise NotATorchFile(f"the file ends before byte {offset + n}")
        return data

    def storage_offset(self, key: str, nbytes: int) -> int:
        """Where storage `key` (of `nbytes`) starts in the file."""
        name = f"{self.prefix}/data/{key}"
        info = self.infos.get(name)
        if info is None or _stored(info).file_size != nbytes:
            raise NotATorchFile(f"storage {key}: missing or of another size")
        return self.base + self.get_record_offset(name)

    def pickle(self) -> bytes:
        """data.pkl's bytes, once the archive is one torch wrote in this host's byte order."""
        order = self.infos.get(f"{self.prefix}/byteorder")
        if order is not None and (_stored(order).file_size > 16 or self.get_record(order.filename) != b"little"):
            raise NotATorchFile("a big-endian file")
        if sys.byteorder != "little":
            raise NotATorchFile("a big-endian host")
        pkl = self.infos.get(f"{self.prefix}/data.pkl")
        if pkl is None:
            raise NotATorchFile("no data.pkl")
        return self.get_record(pkl.filename)


def _stored(info: zipfile.ZipInfo) -> zipfile.ZipInfo:
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1 or info.compress_size != info.file_size:
        raise NotATorchFile(f"{info.filename}: compressed or encrypted")
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
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            records = ZipRecords(f, base, length)
            reader = unpickler(io.BytesIO(records.pickle()), path, records, **unpickler_args)
            self.state = reader.load()
        self.storages = reader.storages
        for st in self.storages.values():
            if st.data_offset + st.nbytes > size:
                raise NotATorchFile(f"storage {st.key} runs past the end of the file")


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
