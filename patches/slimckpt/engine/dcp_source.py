"""The model of an incremental-tier step (`<step>/<role>/dcp/`, committed by `slimckpt_resume.json`)
as merge sources (`merge_input.open_source`): the same `SourceTensor`s `sources.open_checkpoint`
makes of verl's rank files, memory-mapped, so the merge's plan, writers, LoRA and MoE handling read
it unchanged.

What DCP's FileSystemWriter (torch 2.11 and 2.13, `single_file_per_rank`) leaves, checked here:
- `dcp/.metadata`: per state-dict key (`model.<parameter name>`, `optim.…`) the global shape,
  dtype and chunks (offsets, sizes: the saving ranks' shards; replicated copies deduplicated), and
  per chunk the file, byte offset and length of its record.
- each record is a `torch.save` of the chunk (a zip: `data.pkl`, `data/0` stored uncompressed),
  at an arbitrary byte offset of `__{rank}_{i}.distcp`.

Reading a record with DCP's FileSystemReader (`read_data`) `torch.load`s it into anonymous memory
and copies it into the caller's tensor: the merge would hold a bucket of whole tensors. Instead
each record is read by the one `.pt` reader (`pt_index.PtFile` over the record's bytes: its zip
entries, its pickle as tensor records, no tensor built) and the chunk's bytes are mapped read-only
from the .distcp file (`pt_tensors`): file-backed like verl's rank files, so the writers' direct
reads and memory bound apply as they are. Each .distcp file is mapped once and a chunk is a view
of it; records start anywhere, so a view may be unaligned.

No process group: DCP's planner is not run, the metadata is read with FileSystemReader alone (its
pickle checked first: dcp_pickle).
Tied parameters (lm_head.weight viewing embed_tokens.weight) were saved once; the manifest's
`aliases` name them, and the alias reads its target's chunks (verl's rank files hold both names).
"""

from __future__ import annotations

import math
import os
import re

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from slimckpt.engine import pt_index, pt_tensors
from slimckpt.engine.checkpoint_dir import DCP_DIR, CheckpointError
from slimckpt.engine.dcp_pickle import read_metadata
from slimckpt.engine.dcp_step import SOURCE_FORMAT, check_step
from slimckpt.engine.pickle_policy import PickleRefused
from slimckpt.engine.verl_sources import SourceTensor, VerlFsdpCheckpoint
from slimckpt.layout.names import MODEL_PREFIX
from slimckpt.layout.resume_manifest import MANIFEST_NAME, Manifest

_RANK_OF_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def _chunk_tensor(
    path: str, mapping, offset: int, length: int, dtype: torch.dtype, sizes: tuple[int, ...]
) -> torch.Tensor:
    """The chunk saved at [offset, offset + length) of the file `path` and `mapping` (its read-only map)."""
    record = pt_index.PtFile(path, base=offset, length=length).state
    if not isinstance(record, pt_index.TensorRecord):
        raise ValueError(f"the record holds a {type(record).__name__}, not a tensor")
    saved = pt_tensors.torch_dtype(record.dtype)
    if saved != dtype or record.shape != tuple(sizes) or not _contiguous(record.shape, record.stride):
        raise ValueError(
            f"it holds {saved} {list(record.shape)} stride {list(record.stride)}, the "
            f".metadata says {dtype} {list(sizes)} contiguous"
        )
    if math.prod(sizes) == 0:
        return torch.empty(sizes, dtype=dtype)
    return pt_tensors.tensor_at(mapping, record.offset, dtype, tuple(sizes))


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Row-major without gaps (dims of size 1 may have any stride, as torch's is_contiguous allows)."""
    expect = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expect:
            return False
        expect *= size
    return True


def open_dcp(local_dir: str, manifest: Manifest | None = None, prefix: str = MODEL_PREFIX) -> VerlFsdpCheckpoint:
    """The model tensors of a committed incremental step, as merge sources; raises CheckpointError.
    `manifest`: checked by `check_step` already; else it is checked here, sizes only (the merge
    checks the checksums once, before it opens the step: `check_step`). `prefix`: the keys read
    (`optim.state.` for the optimizer's tensors, which `slimckpt convert` reads)."""
    local_dir = os.path.abspath(local_dir)
    manifest = manifest or check_step(local_dir, checksums=False)
    dcp_dir = os.path.join(local_dir, DCP_DIR)
    meta_path = os.path.join(dcp_dir, ".metadata")
    try:
        metadata = read_metadata(dcp_dir)
    except PickleRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a damaged pickle
        raise CheckpointError(
            f"{meta_path}: unreadable ({type(exc).__name__}: {str(exc)[:120]}); the checkpoint "
            f"is damaged, merge an earlier step"
        ) from None
    ckpt = VerlFsdpCheckpoint(
        local_dir=local_dir,
        world_size=manifest.world_size,
        fsdp_version=manifest.fsdp_version,
        state_dicts=[],
        tensors={},
        mesh=None,
        source_format=SOURCE_FORMAT,
    )
    handles: dict[str, object] = {}  # path -> its mapping, held by the tensors viewing it
    for key, meta in metadata.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if isinstance(meta, BytesStorageMetadata) or not isinstance(meta, TensorStorageMetadata):
            ckpt.skipped.append(name)
            continue
        ckpt.tensors[name] = _source(key, name, meta, metadata.storage_data, MetadataIndex, dcp_dir, handles, meta_path)
    if prefix != MODEL_PREFIX:
        return ckpt
    if not ckpt.tensors:
        raise CheckpointError(
            f"{meta_path}: holds no model tensors (no '{MODEL_PREFIX}*' keys); not a model save of the incremental tier"
        )
    for alias, target in dict(manifest.extra.get("aliases") or {}).items():
        if target not in ckpt.tensors:
            raise CheckpointError(
                f"{os.path.join(local_dir, MANIFEST_NAME)}: alias {alias!r} names {target!r}, which "
                f"{meta_path} does not hold; the checkpoint is damaged, merge an earlier step"
            )
        src = ckpt.tensors[target]
        ckpt.tensors[alias] = SourceTensor(
            alias,
            src.shape,
            src.dtype,
            src.shard_dim,
            src.pieces,
            src.ranks,
            src.replicated_dtensor,
            local_dir,
            manifest.world_size,
            list(src.files),
        )
    return ckpt


def _source(
    key: str, name: str, meta, storage_data: dict, index_cls, dcp_dir: str, handles: dict, meta_path: str
) -> SourceTensor:
    shape = tuple(meta.size)
    dtype = meta.properties.dtype
    chunks = [c for c in meta.chunks if math.prod(c.sizes) > 0 or not shape]
    if not chunks and math.prod(shape) == 0:  # an empty parameter: nothing to read
        return SourceTensor(
            name, shape, dtype, None, [torch.empty(shape, dtype=dtype)], [0], local_dir=os.path.dirname(dcp_dir)
        )
    dim = _shard_dim(shape, chunks)
    if dim is None and len(chunks) != 1:
        raise CheckpointError(
            f"{meta_path}: {name!r} is saved as {len(chunks)} chunks that are not shards of one "
            f"dim (FSDP + tensor parallel?); only FSDP/HSDP steps can be merged"
        )
    if dim is not None:
        chunks.sort(key=lambda c: c.offsets[dim])
        expect = 0
        for c in chunks:
            if c.offsets[dim] != expect:
                raise CheckpointError(
                    f"{meta_path}: the chunks of {name!r} leave a gap or overlap at row {expect} of "
                    f"dim {dim}; the checkpoint is damaged, merge an earlier step"
                )
            expect += c.sizes[dim]
        if expect != shape[dim]:
            raise CheckpointError(
                f"{meta_path}: the chunks of {name!r} cover {expect} of {shape[dim]} rows of dim "
                f"{dim}; the checkpoint is damaged, merge an earlier step"
            )
    pieces, ranks, files = [], [], []
    for c in chunks:
        info = storage_data.get(index_cls(key, c.offsets))
        if info is None:
            raise CheckpointError(
                f"{meta_path}: no storage entry for the chunk of {name!r} at {list(c.offsets)}; "
                f"the checkpoint is damaged, merge an earlier step"
            )
        path = os.path.join(dcp_dir, info.relative_path)
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{path}: the chunk of {name!r} was saved through storage transforms "
                f"{info.transform_descriptors}, which the merge does not read"
            )
        if path not in handles:
            try:
                handles[path] = pt_tensors.mapping(path, pt_tensors.READ)
                if handles[path] is None:
                    raise ValueError("cannot mmap an empty file")
            except (OSError, ValueError) as exc:
                raise CheckpointError(
                    f"{path}: cannot be read ({exc}); the checkpoint is damaged, merge an earlier step"
                ) from None
        try:
            t = _chunk_tensor(path, handles[path], info.offset, info.length, dtype, tuple(c.sizes))
        except PickleRefused as exc:
            raise PickleRefused(exc.path, exc.global_name, f"the record of {key!r} at byte {info.offset}") from None
        except Exception as exc:  # noqa: BLE001 - a damaged record raises from torch's zip reader or the pickle
            raise CheckpointError(
                f"{path}: the record of {name!r} at byte {info.offset} is not the chunk .metadata "
                f"describes ({str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}); "
                f"the checkpoint is damaged, merge an earlier step"
            ) from None
        m = _RANK_OF_FILE.match(info.relative_path)
        pieces.append(t)
        ranks.append(int(m.group(1)) if m else 0)
        files.append(path)
    local_dir = os.path.dirname(dcp_dir)
    return SourceTensor(name, shape, dtype, dim, pieces, ranks, local_dir=local_dir, files=files)


def _shard_dim(shape: tuple[int, ...], chunks: list) -> int | None:
    """The one dim the chunks split (each chunk whole on every other dim); None for one whole chunk."""
    if len(chunks) == 1 and tuple(chunks[0].sizes) == shape:
        return None
    dims = {d for c in chunks for d in range(len(shape)) if c.sizes[d] != shape[d]}
    if len(dims) != 1:
        return None
    dim = dims.pop()
    if any(c.offsets[d] for c in chunks for d in range(len(shape)) if d != dim):
        return None
    return dim
