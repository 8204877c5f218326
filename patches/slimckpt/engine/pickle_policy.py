"""What slimckpt unpickles from a checkpoint: the globals verl 0.9.1 and torch write, nothing else.

verl's rank files, its extra state, DCP's `.metadata` and DCP's non-tensor records are pickles, and
unpickling runs whatever callable a pickle names (`os.system` as easily as a tensor rebuild). Every
reader of checkpoint files asks this module first: a pickle global is looked up only when it is in
`ALLOWED`, and anything else is refused before it runs, naming the file and the global
(`PickleRefused`). The readers enforce it in three ways, all from this one list:

- `RestrictedUnpickler`: a `pickle.Unpickler` whose `find_class` checks the list: **the** unpickler
  of every checkpoint pickle slimckpt reads itself. The one `.pt` reader (`pt_index`, and
  `pt_tensors` where torch is loaded) subclasses it and resolves allowed globals its own way
  (`resolve`); DCP's `.metadata` is read with it (`dcp_pickle`).
- `check_bytes` / `check_file`: the same check over a pickle, or over the `data.pkl` of a
  `torch.save` zip (read opcode by opcode, nothing built), for files another library unpickles
  itself (DCP's byte records, verl's own load).

Opt-out, for exotic but trusted files: `SLIMCKPT_TRUST_PICKLE=1` (what `--trust-pickle` and the
trainer's `checkpoint.trust_pickle` set) allows every global, as `torch.load(weights_only=False)`.

No torch here (the merge's torch-free index uses it).
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import io
import os
import pickle
import pickletools
import zipfile
from collections.abc import Iterator

from slimckpt import env_vars
from slimckpt.engine.checkpoint_dir import CheckpointError
from slimckpt.storage import for_path, is_url

TRUST_ENV = "SLIMCKPT_TRUST_PICKLE"
# a file each refusal is appended to ("<file>\t<global>"), when set: the test suite fails a test
# whose legitimate checkpoint was refused anywhere, in any process
REFUSALS_LOG_ENV = "SLIMCKPT_PICKLE_REFUSALS_LOG"

_TORCH_DTYPES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex128",
    "complex64",
    "complex32",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "float8_e5m2",
    "float8_e4m3fn",
    "float8_e5m2fnuz",
    "float8_e4m3fnuz",
    "float8_e8m0fnu",
)
# the legacy storage classes torch.save names for the older dtypes (newer ones: UntypedStorage + dtype)
_TORCH_STORAGES = (
    "UntypedStorage",
    "DoubleStorage",
    "FloatStorage",
    "HalfStorage",
    "BFloat16Storage",
    "LongStorage",
    "IntStorage",
    "ShortStorage",
    "CharStorage",
    "ByteStorage",
    "BoolStorage",
    "ComplexDoubleStorage",
    "ComplexFloatStorage",
)
_SHARDED = "torch.distributed._shard"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# the members of the two memory-format enums that sharded and DCP metadata pickle. Some Python 3.11
# releases (3.11.2, Debian 12's python3, does; 3.11.7 does not) pickle an Enum member by name, as
# getattr(<enum class>, "<member>"); others as <enum class>(<value>): both forms must load
_MEM_FORMATS = ("TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST", "TORCH_PRESERVE_FORMAT")

# (module, name) as a pickle names them. Only constructors of data: none of them calls a function
# it is handed, imports a module it is told, or reads or writes a file.
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        # containers
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("_codecs", "encode"),  # how protocol 2 pickles bytes (numpy arrays' data, their dtype codes)
        # tensors and what describes them
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_tensor_v3"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch._utils", "_rebuild_parameter_with_state"),
        ("torch._utils", "_rebuild_wrapper_subclass"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch", "Tensor"),  # the type _rebuild_from_type_v2 restores: FSDP1 at one rank saves plain tensors so
        ("torch.nn.parameter", "Parameter"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch", "strided"),
        ("torch", "contiguous_format"),
        ("torch", "channels_last"),
        ("torch", "preserve_format"),
        *(("torch", name) for name in _TORCH_DTYPES),
        *(("torch", name) for name in _TORCH_STORAGES),
        # FSDP2 (and FSDP1 on a device mesh): DTensor, its spec, placements and mesh
        ("torch.distributed.tensor", "DTensor"),
        ("torch.distributed.tensor._api", "DTensor"),
        ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
        ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
        ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"),
        ("torch.distributed.tensor.placement_types", "Shard"),
        ("torch.distributed.tensor.placement_types", "Replicate"),
        ("torch.distributed.tensor.placement_types", "Partial"),
        ("torch.distributed.tensor.placement_types", "_StridedShard"),
        ("torch.distributed.device_mesh", "DeviceMesh"),
        ("torch.distributed._mesh_layout", "_MeshLayout"),
        ("torch.distributed._mesh_layout", "_FlatLayout"),
        # FSDP1 without a device mesh: ShardedTensor, its shards and metadata
        (f"{_SHARDED}.sharded_tensor.api", "ShardedTensor"),
        (f"{_SHARDED}.sharded_tensor.api", "ShardedTensor.ProcessGroupState"),
        (f"{_SHARDED}.sharded_tensor.shard", "Shard"),
        (f"{_SHARDED}.sharded_tensor.metadata", "ShardedTensorMetadata"),
        (f"{_SHARDED}.sharded_tensor.metadata", "TensorProperties"),
        (f"{_SHARDED}.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
        *((f"{_SHARDED}.sharded_tensor.metadata", f"MEM_FORMAT_ENCODING.{m}") for m in _MEM_FORMATS),
        (f"{_SHARDED}.metadata", "ShardMetadata"),
        (f"{_SHARDED}.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec"),
        ("torch.distributed.remote_device", "_remote_device"),  # a shard's placement: parses "rank:0/cpu"
        # DCP's .metadata (the incremental tier's steps)
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        *((_DCP_METADATA, f"_MEM_FORMAT_ENCODING.{m}") for m in _MEM_FORMATS),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the directory the step was saved to
        ("pathlib._local", "PosixPath"),  # the same, pickled by Python 3.13 (pathlib became a package)
        # numpy's RNG state in extra_state (MT19937 key: a uint32 array)
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        # never named by a pickle, but torch's weights_only loader asks for the dtype's class to BUILD it
        *(
            ("numpy.dtypes", f"{kind}DType")
            for kind in (
                "UInt8",
                "UInt16",
                "UInt32",
                "UInt64",
                "Int8",
                "Int16",
                "Int32",
                "Int64",
                "Float16",
                "Float32",
                "Float64",
                "Bool",
            )
        ),
    }
)

REFUSED_PREFIX = "refused: pickle global"
TRUST_HINT = "pass --trust-pickle (trainer: checkpoint.trust_pickle=true) only if you trust who made it"


class PickleRefused(CheckpointError):
    """A pickle in a checkpoint names a global outside `ALLOWED`; nothing of it was run. The message
    is one line: the file (and `part`, the record in it), the global, and what would allow it."""

    def __init__(self, path: str, global_name: str, part: str = "") -> None:
        self.path, self.global_name, self.part = path, global_name, part
        where = f"{path} ({part})" if part else path
        super().__init__(
            f"{where}: {REFUSED_PREFIX} {global_name}, which verl and torch never write "
            f"(unpickling it could run code), so nothing was loaded from it; {TRUST_HINT}"
        )

    @property
    def reason(self) -> str:
        """What `slimckpt verify` reports next to the file's path."""
        name = os.path.basename(self.path) or self.path
        return f"{REFUSED_PREFIX} {self.global_name} in {name}" + (f" ({self.part})" if self.part else "")


def trusted() -> bool:
    """Whether every global is allowed (SLIMCKPT_TRUST_PICKLE=1)."""
    return env_vars.flag(TRUST_ENV)


def set_trusted(on: bool) -> None:
    """Allow every global in this process and the processes it starts (--trust-pickle)."""
    if on:
        env_vars.set_flag(TRUST_ENV, True)


@contextlib.contextmanager
def trusting(on: bool) -> Iterator[None]:
    """`set_trusted` for the duration of a load (the trainer's config key); no-op when `on` is false."""
    if not on or trusted():
        yield
        return
    env_vars.set_flag(TRUST_ENV, True)
    try:
        yield
    finally:
        env_vars.set_flag(TRUST_ENV, False)


def _canonical(module: str, name: str) -> tuple[str, str]:
    # protocol 2 pickles name Python 2's modules (__builtin__, copy_reg); pickle maps them back
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def is_allowed(module: str, name: str) -> bool:
    return _canonical(module, name) in ALLOWED


def check_global(module: str, name: str, path: str) -> None:
    """Raise PickleRefused unless `module.name` may be looked up in a pickle of `path`."""
    if is_allowed(module, name) or trusted():
        return
    refuse(f"{module}.{name}", path)


def refuse(global_name: str, path: str) -> None:
    log = env_vars.path(REFUSALS_LOG_ENV)
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{path}\t{global_name}\n")
    raise PickleRefused(path, global_name)


class RestrictedUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that looks up only allowed globals; `resolve` says what an allowed one is.

    `getattr`, which protocol 2 pickles use to name a nested class (ShardedTensor.ProcessGroupState)
    and some Python releases an Enum member, is given only for such a name that is itself allowed."""

    path = "<pickle>"

    def find_class(self, module: str, name: str):
        if _canonical(module, name) == ("builtins", "getattr") and not trusted():
            return self._nested
        check_global(module, name, self.path)
        found = self.resolve(module, name)
        self.__dict__.setdefault("_names", {})[id(found)] = (module, name)
        return found

    def resolve(self, module: str, name: str):
        return super().find_class(module, name)

    def _nested(self, owner, attr):
        module, name = self.__dict__.get("_names", {}).get(id(owner), ("builtins", "getattr"))
        check_global(module, f"{name}.{attr}" if type(attr) is str else f"{name}.?", self.path)
        return getattr(owner, attr)


# --- checking a pickle without building it ---

_STRING_OPS = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}
)
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_GETATTR = ("builtins", "getattr")


def check_bytes(data: bytes, path: str) -> None:
    """Raise PickleRefused if the pickle(s) in `data` (of file `path`) name a global outside ALLOWED.

    First as the restricted loader reads them (C speed; what it builds is only of allowed globals,
    and is dropped). Where that stops early (a persistent id: a legacy torch file; damage), the
    rest could hold anything, so the bytes are then read opcode by opcode (`scan_ops`)."""
    if trusted():
        return
    stream = io.BytesIO(data)
    try:
        while stream.tell() < len(data):
            unpickler = RestrictedUnpickler(stream)
            unpickler.path = path
            unpickler.load()
        return
    except PickleRefused:
        raise
    except Exception:  # noqa: BLE001 - not a plain pickle: every opcode, unbuilt
        pass
    scan_ops(data, path)


def scan_ops(data: bytes, path: str) -> None:
    """`check_bytes` opcode by opcode (pickletools), nothing built or called: every global the
    pickle(s) name, wherever they are. A global whose name the pickle computes instead of spelling
    it out (STACK_GLOBAL of anything but two strings), an extension code, or a `getattr` other
    than `getattr(<allowed class>, "<allowed nested name>")` is refused too. Damage that stops the
    parse is left to the real load, which reports it."""
    if trusted():
        return
    stream = io.BytesIO(data)
    while stream.tell() < len(data):
        try:
            ops = [(op.name, arg) for op, arg, _ in pickletools.genops(stream)]
        except Exception:  # noqa: BLE001 - damaged: the real load says what is wrong
            return
        _check_ops(ops, path)


def _check_ops(ops: list[tuple[str, object]], path: str) -> None:
    memo: dict[int, tuple | None] = {}
    pushed: list[tuple | None] = []  # what each op (memo ops skipped) left on top of the stack, when known
    for i, (name, arg) in enumerate(ops):
        if name in _PUT_OPS:
            memo[len(memo) if name == "MEMOIZE" else int(arg)] = pushed[-1] if pushed else None
            continue
        value = _pushed(name, arg, memo)
        if name in ("GLOBAL", "INST"):
            module, _, attr = str(arg).partition(" ")
            value = ("global", module, attr)
        elif name == "STACK_GLOBAL":
            if len(pushed) < 2 or not all(v and v[0] == "str" for v in pushed[-2:]):
                refuse("(a global whose name the pickle computes)", path)
            value = ("global", pushed[-2][1], pushed[-1][1])
        elif name.startswith("EXT"):
            refuse(f"(extension code {arg})", path)
        if value is not None and value[0] == "global":
            _check_pushed_global(value[1], value[2], ops, i, memo, path)
        pushed.append(value)


def _check_pushed_global(
    module: str, name: str, ops: list[tuple[str, object]], i: int, memo: dict[int, tuple | None], path: str
) -> None:
    if _canonical(module, name) != _GETATTR:
        check_global(module, name, path)
        return
    # getattr only as protocol 2 names a nested class, or an Enum member by name: getattr(<global>,
    # "<name>"), called at once; the global spelled out (GLOBAL), fetched from the memo, or looked up
    # from two strings (STACK_GLOBAL, protocol 4)
    after = [(n, a) for n, a in ops[i + 1 : i + 16] if n not in _PUT_OPS][:6]
    kinds = [n for n, _ in after]
    owner, rest = None, after
    if len(kinds) >= 3 and kinds[2] == "STACK_GLOBAL":
        names = [_pushed(n, a, memo) for n, a in after[:2]]
        if all(v and v[0] == "str" for v in names):
            owner, rest = ("global", names[0][1], names[1][1]), after[3:]
    elif kinds[:1] == ["GLOBAL"]:
        owner, rest = ("global", *str(after[0][1]).partition(" ")[::2]), after[1:]
    elif kinds[:1] and kinds[0] in _GET_OPS:
        owner, rest = _pushed(*after[0], memo), after[1:]  # puts between here and there store getattr only
    rest_kinds = [n for n, _ in rest[:3]]
    if (
        owner is not None
        and owner[0] == "global"
        and len(rest_kinds) == 3
        and rest_kinds[0] in _STRING_OPS
        and rest_kinds[1:] == ["TUPLE2", "REDUCE"]
        and isinstance(rest[0][1], str)
    ):
        check_global(owner[1], f"{owner[2]}.{rest[0][1]}", path)
        return
    refuse(f"{module}.{name}", path)


def _pushed(op: str, arg: object, memo: dict[int, tuple | None]) -> tuple | None:
    """What a string or memo-get op leaves on the stack, as the scan tracks it (("str", text), or
    what the memo holds); None for any other op."""
    if op in _STRING_OPS:
        return ("str", arg if isinstance(arg, str) else bytes(arg).decode("latin-1"))
    if op in _GET_OPS:
        return memo.get(int(arg))
    return None


def check_torch_bytes(data: bytes, path: str) -> None:
    """`check_bytes` of what `torch.save` wrote into `data`: its zip's data.pkl, or a plain pickle."""
    if trusted():
        return
    if not zipfile.is_zipfile(io.BytesIO(data)):
        check_bytes(data, path)
        return
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        _check_zip(zf, path)


def read_all(f) -> bytes:
    """Every byte of an open file (a raw stream may return less than asked per read)."""
    parts = []
    while chunk := f.read(8 << 20):
        parts.append(chunk)
    return b"".join(parts)


_CHECKED: set[tuple] = set()  # files found clean in this process, by identity (a load opens one twice)
_CHECKED_MAX = 4096


def check_file(path: str) -> None:
    """`check_torch_bytes` of a file, reading only its pickles (never a tensor's bytes)."""
    if trusted():
        return
    if is_url(path):  # a remote file (a step's small pickles: extra state, .metadata) is checked whole
        try:
            with for_path(path).open_read(path) as f:
                data = read_all(f)
        except OSError:
            return  # missing or unreadable: the real load reports it
        check_torch_bytes(data, path)
        return
    try:
        st = os.stat(path)
        is_zip = zipfile.is_zipfile(path)
    except OSError:
        return  # missing or unreadable: the real load reports it
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _CHECKED:
        return
    if not is_zip:
        with open(path, "rb") as f:
            check_bytes(f.read(), path)
    else:
        try:
            with zipfile.ZipFile(path) as zf:
                _check_zip(zf, path)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError):
            return
    if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.clear()
    _CHECKED.add(key)


def _check_zip(zf: zipfile.ZipFile, path: str) -> None:
    for info in zf.infolist():
        if info.filename.endswith(".pkl"):  # data.pkl, and any other pickle torch's format may hold
            try:
                data = zf.read(info)
            except (zipfile.BadZipFile, OSError, EOFError, ValueError):
                continue  # a CRC error: the real load (or verify's CRC check) reports it
            scan_ops(data, path)  # its persistent ids (storages) stop the restricted loader
