"""Pure planning of Hugging Face safetensors output: tensor specs -> files, headers, byte offsets.

Nothing here touches torch or the filesystem. Dtypes are safetensors' own names ("BF16", "F32").
The rules reproduce, byte for byte, what `transformers.PreTrainedModel.save_pretrained` writes
through `huggingface_hub.split_torch_state_dict_into_shards` and `safetensors.torch.save_file`
(safetensors 0.8): so a file written from a plan equals what those libraries write for the same
tensors, and every byte of it has a known owner before a single tensor is read.

Data flow: `plan_files(specs, max_shard_size)` -> `Plan` (files with headers and absolute
offsets) -> `partition(plan, n)` (which worker writes which row range) -> `source_ranges(...)`
(which bytes of the file a source shard covers).

Where an output tensor is not one whole checkpoint tensor but a part of one (transformers 5 stores
an MoE layer's experts fused, `[E, 2I, H]`, and splits them per expert on save), its `Take` names the
run of the source's elements it is, in row-major order, and `take_ranges(...)` says which source
shard holds which of those elements.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from slimckpt import SlimckptError
from slimckpt.layout.names import DTYPE_BYTES, DTYPE_ORDER

_DTYPE_RANK = {name: i for i, name in enumerate(DTYPE_ORDER)}

# huggingface_hub's units are decimal: "5GB" is 5 * 10**9 bytes.
SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
WEIGHTS_PATTERN = "model{suffix}.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_METADATA = {"format": "pt"}
HEADER_LEN_BYTES = 8


class LayoutError(SlimckptError, ValueError):
    pass


def parse_size(size: int | str) -> int:
    """'5GB' -> 5_000_000_000, as huggingface_hub's `parse_size_to_int` reads it; ints pass through."""
    if isinstance(size, int):
        return size
    text = size.strip()
    unit = text[-2:].upper()
    if unit not in SIZE_UNITS:
        raise LayoutError(f"size {size!r}: use one of the units TB, GB, MB, KB (e.g. '5GB')")
    try:
        value = float(text[:-2].strip())
    except ValueError:
        raise LayoutError(f"size {size!r}: give a number followed by a unit, e.g. '5GB'") from None
    return int(value * SIZE_UNITS[unit])


def dim0_rows(shape: tuple[int, ...]) -> int:
    """Rows along dim 0, the dim FSDP shards; a 0-d tensor is one row of one element."""
    return shape[0] if shape else 1


def dim0_row_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of one dim-0 row of a row-major tensor."""
    return math.prod(shape[1:]) * itemsize if shape else itemsize


@dataclass(frozen=True)
class TensorSpec:
    """One output tensor: its name in the HF state dict, safetensors dtype, global shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise LayoutError(
                f"tensor {self.name!r}: dtype {self.dtype!r} is not supported "
                f"(supported: {', '.join(sorted(DTYPE_BYTES))})"
            )
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def rows(self) -> int:
        return dim0_rows(self.shape)

    @property
    def row_bytes(self) -> int:
        return dim0_row_bytes(self.shape, self.itemsize)


@dataclass(frozen=True)
class Placement:
    """Where one tensor lives in its file: absolute byte range [begin, end)."""

    spec: TensorSpec
    file: str
    begin: int
    end: int

    def rows_to_bytes(self, row_start: int, row_end: int) -> tuple[int, int]:
        """Absolute byte range of rows [row_start, row_end) of this tensor."""
        if not 0 <= row_start <= row_end <= self.spec.rows:
            raise LayoutError(f"{self.spec.name}: rows [{row_start}, {row_end}) outside [0, {self.spec.rows})")
        rb = self.spec.row_bytes
        return self.begin + row_start * rb, self.begin + row_end * rb


@dataclass(frozen=True)
class FileLayout:
    """One safetensors file: its header bytes and every tensor's absolute placement."""

    name: str
    header: bytes  # the 8-byte length prefix included
    placements: tuple[Placement, ...]  # in file order

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def size(self) -> int:
        return self.placements[-1].end if self.placements else len(self.header)

    @property
    def data_bytes(self) -> int:
        return self.size - self.data_start


@dataclass(frozen=True)
class Plan:
    files: tuple[FileLayout, ...]
    total_size: int  # sum of tensor bytes, as huggingface_hub counts it for the index
    placements: dict[str, Placement] = field(repr=False)

    @property
    def is_sharded(self) -> bool:
        return len(self.files) > 1

    @property
    def weight_map(self) -> dict[str, str]:
        return {name: p.file for name, p in self.placements.items()}

    def index(self, total_parameters: int | None = None) -> dict | None:
        """model.safetensors.index.json as transformers writes it; None for a single file."""
        if not self.is_sharded:
            return None
        metadata: dict[str, int] = {"total_size": self.total_size}
        if total_parameters is not None:
            metadata = {"total_parameters": total_parameters, **metadata}
        return {"metadata": metadata, "weight_map": self.weight_map}

    def index_json(self, total_parameters: int | None = None) -> str | None:
        index = self.index(total_parameters)
        return None if index is None else json.dumps(index, indent=2, sort_keys=True) + "\n"


def split_into_files(
    specs: Sequence[TensorSpec], max_shard_size: int | str, pattern: str = WEIGHTS_PATTERN
) -> list[tuple[str, list[TensorSpec]]]:
    """Group tensors into files in state-dict order, as huggingface_hub does.

    Greedy: a tensor that would push the current file over the limit starts a new one; a tensor
    larger than the limit gets a file of its own, placed before the file being filled.
    """
    limit = parse_size(max_shard_size)
    _check_unique(specs)
    groups: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    current_size = 0
    for spec in specs:
        if spec.nbytes > limit:
            groups.append([spec])
            continue
        if current_size + spec.nbytes > limit:
            groups.append(current)
            current, current_size = [], 0
        current.append(spec)
        current_size += spec.nbytes
    if current:
        groups.append(current)
    if len(groups) <= 1:
        return [(pattern.format(suffix=""), groups[0] if groups else [])]
    n = len(groups)
    return [(pattern.format(suffix=f"-{i + 1:05d}-of-{n:05d}"), g) for i, g in enumerate(groups)]


def safetensors_order(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """The order safetensors writes tensors in: dtype descending in its enum, then name."""
    return sorted(specs, key=lambda s: (-_DTYPE_RANK[s.dtype], s.name.encode("utf-8")))


def header_bytes(
    entries: Sequence[tuple[TensorSpec, int, int]], metadata: dict[str, str] | None = DEFAULT_METADATA
) -> bytes:
    """8-byte little-endian length + compact JSON header padded with spaces to a multiple of 8.

    `entries` are (spec, begin, end) relative to the start of the data section, in file order.
    """
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    for spec, begin, end in entries:
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [begin, end]}
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def plan_file(name: str, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = DEFAULT_METADATA) -> FileLayout:
    _check_unique(specs)
    ordered = safetensors_order(specs)
    entries, offset = [], 0
    for spec in ordered:
        entries.append((spec, offset, offset + spec.nbytes))
        offset += spec.nbytes
    header = header_bytes(entries, metadata)
    base = len(header)
    placements = tuple(Placement(spec, name, base + b, base + e) for spec, b, e in entries)
    return FileLayout(name=name, header=header, placements=placements)


def plan_files(
    specs: Sequence[TensorSpec],
    max_shard_size: int | str,
    metadata: dict[str, str] | None = DEFAULT_METADATA,
    pattern: str = WEIGHTS_PATTERN,
) -> Plan:
    """Specs in state-dict order -> every output file with header and absolute offsets."""
    files = tuple(plan_file(name, group, metadata) for name, group in split_into_files(specs, max_shard_size, pattern))
    placements = {p.spec.name: p for f in files for p in f.placements}
    # index order follows the state dict, as transformers' weight_map does (json sorts it anyway)
    placements = {s.name: placements[s.name] for s in specs}
    return Plan(files=files, total_size=sum(s.nbytes for s in specs), placements=placements)


@dataclass(frozen=True)
class Segment:
    """Rows [row_start, row_end) of one tensor, to be written by one worker."""

    name: str
    row_start: int
    row_end: int


@dataclass(frozen=True)
class FileRange:
    """Absolute byte range [begin, end) of one output file: the unit a checksum pass reads."""

    file: str
    begin: int
    end: int


def partition(plan: Plan, n_workers: int) -> list[list[Segment]]:
    """Split all tensor data into `n_workers` contiguous shares of nearly equal bytes.

    Boundaries fall on row boundaries (the unit a source shard is cut in), in file then offset
    order, so a share is a few long sequential runs and the result depends only on (plan, n).
    Zero-byte tensors go to the worker that owns their offset; headers are not in any share.
    """
    if n_workers < 1:
        raise LayoutError(f"need at least one worker, got {n_workers}")
    ordered = [p for f in plan.files for p in f.placements]
    total = sum(p.end - p.begin for p in ordered)
    cuts = [total * k // n_workers for k in range(n_workers + 1)]  # global data positions
    shares: list[list[Segment]] = [[] for _ in range(n_workers)]
    pos = 0
    for p in ordered:
        size, rb, rows = p.end - p.begin, p.spec.row_bytes, p.spec.rows
        if size == 0:
            shares[_owner(cuts, pos)].append(Segment(p.spec.name, 0, rows))
            continue
        row = 0
        while row < rows:
            worker = _owner(cuts, pos + row * rb)
            # first row whose start lies at or beyond the next cut
            end_row = rows if worker == n_workers - 1 else min(rows, max(row + 1, -(-(cuts[worker + 1] - pos) // rb)))
            shares[worker].append(Segment(p.spec.name, row, end_row))
            row = end_row
        pos += size
    return shares


def _owner(cuts: list[int], position: int) -> int:
    """Index k with cuts[k] <= position < cuts[k+1] (the last worker takes the tail)."""
    lo, hi = 0, len(cuts) - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cuts[mid] <= position:
            lo = mid
        else:
            hi = mid - 1
    return lo


def partition_files(plan: Plan, n_workers: int) -> list[list[str]]:
    """Assign whole files to workers (for checksum passes), largest first, to the least loaded."""
    load = [0] * n_workers
    out: list[list[str]] = [[] for _ in range(n_workers)]
    for f in sorted(plan.files, key=lambda f: (-f.size, f.name)):
        k = min(range(n_workers), key=lambda i: (load[i], i))
        out[k].append(f.name)
        load[k] += f.size
    return [sorted(names) for names in out]


@dataclass(frozen=True)
class SourceRange:
    """What one source shard contributes to a segment: its local rows and where they go."""

    source: int  # index of the source shard (e.g. its position along the FSDP mesh dim)
    local_start: int  # rows inside the source shard
    local_end: int
    begin: int  # absolute byte range in the output file
    end: int


def shard_rows(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Per-shard dim-0 sizes in shard order -> global row ranges [start, end)."""
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def source_ranges(
    placement: Placement, shard_sizes: Sequence[int], row_start: int = 0, row_end: int | None = None
) -> list[SourceRange]:
    """Which source shard covers which bytes of rows [row_start, row_end) of `placement`.

    `shard_sizes` are the dim-0 lengths of the source shards in order (FSDP's Shard(0): may be
    uneven, may be 0); they must add up to the tensor's rows.
    """
    rows = placement.spec.rows
    row_end = rows if row_end is None else row_end
    if sum(shard_sizes) != rows:
        raise LayoutError(
            f"{placement.spec.name}: shard rows {list(shard_sizes)} add up to {sum(shard_sizes)}, tensor has {rows}"
        )
    out = []
    for k, (s, e) in enumerate(shard_rows(shard_sizes)):
        a, b = max(s, row_start), min(e, row_end)
        if a >= b:
            continue
        begin, end = placement.rows_to_bytes(a, b)
        out.append(SourceRange(k, a - s, b - s, begin, end))
    return out


@dataclass(frozen=True)
class LoraDelta:
    """A LoRA adapter merged into its base weight: the output is W + (B @ A) * scaling, W the take's
    source [out, in], B checkpoint tensor `b` [out, r], A checkpoint tensor `a` [r, in]."""

    a: str
    b: str
    scaling: float


@dataclass(frozen=True)
class Take:
    """Where one output tensor's elements come from: checkpoint tensor `source`, whole (`span` None),
    or its elements [span[0], span[1]) in row-major order, read as `shape` (the output's shape).

    Every part transformers 5 splits off a fused tensor on save is such a run: expert e of an
    `[E, R, C]` tensor is elements [e*R*C, (e+1)*R*C), the first half of its rows [e*R*C, e*R*C + R*C/2).
    A whole take with a `delta` is its source with a LoRA adapter merged in (`slimckpt merge --merge_lora`)."""

    source: str
    shape: tuple[int, ...]
    span: tuple[int, int] | None = None
    delta: LoraDelta | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.span is not None:
            a, b = (int(x) for x in self.span)
            if not 0 <= a <= b or b - a != math.prod(self.shape):
                raise LayoutError(f"{self.source}: elements [{a}, {b}) cannot be read as shape {list(self.shape)}")
            object.__setattr__(self, "span", (a, b))
        if self.delta is not None and (self.span is not None or len(self.shape) != 2):
            raise LayoutError(f"{self.source}: a LoRA delta merges into a whole 2-D weight only")

    @property
    def whole(self) -> bool:
        return self.span is None

    def check_source(self, source_shape: Sequence[int]) -> None:
        """Raise LayoutError unless the source (of `source_shape`) holds what this take reads."""
        numel = math.prod(source_shape)
        if self.span is None:
            if tuple(source_shape) != self.shape:
                raise LayoutError(f"{self.source}: shape {list(source_shape)}, the plan expects {list(self.shape)}")
        elif self.span[1] > numel:
            raise LayoutError(f"{self.source}: elements [{self.span[0]}, {self.span[1]}) past its {numel} elements")


@dataclass(frozen=True)
class ElementRange:
    """Elements [local_start, local_end) of source shard `source` (row-major, counted from the
    shard's first element) are output elements [out_start, out_start + local_end - local_start)."""

    source: int
    local_start: int
    local_end: int
    out_start: int


def take_ranges(span_start: int, shard_elements: Sequence[int], out_start: int, out_end: int) -> list[ElementRange]:
    """Which source shard covers which of output elements [out_start, out_end), for an output that is
    the source's elements from `span_start` on, and a source cut in row-major order into shards of
    `shard_elements` elements each (FSDP's Shard(0): rows x elements per row; one entry for an
    unsharded source)."""
    out = []
    g0, g1 = span_start + out_start, span_start + out_end
    base = 0
    for k, n in enumerate(shard_elements):
        a, b = max(base, g0), min(base + n, g1)
        if a < b:
            out.append(ElementRange(k, a - base, b - base, a - span_start))
        base += n
    if out_end > out_start and sum(e.local_end - e.local_start for e in out) != out_end - out_start:
        raise LayoutError(f"elements [{g0}, {g1}) lie past the source's {base} elements")
    return out


def _check_unique(specs: Sequence[TensorSpec]) -> None:
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise LayoutError(f"tensor {s.name!r} appears twice")
        seen.add(s.name)
