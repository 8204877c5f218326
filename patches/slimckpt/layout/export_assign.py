"""Pure planning of the gather-free HF export: which rank writes which part of each tensor.

Every rank holds boxes of the model's tensors (FSDP's Shard(0): a run of dim-0 rows; a replicated
tensor: the whole tensor; a 2-D (ddp, fsdp) mesh: the same rows on every replica). Each distinct
box is written by exactly one of the ranks that hold it, the least loaded so far, so replicas and
replicated tensors are written once and the bytes spread over the ranks. A box maps to one or
more contiguous byte runs of the row-major tensor (one run when only dim 0 is cut).

An output that is a part of a source (transformers 5 splits an MoE layer's fused experts per expert
on save: `layout.Take`, a run of the source's elements) is written by the ranks whose boxes of the
source overlap it: `take_pieces` says which of a box's elements go where in the output.

No torch and no torch.distributed here: the inputs are plain tuples every rank reports.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slimckpt import SlimckptError


class AssignError(SlimckptError, ValueError):
    """The ranks' boxes do not cover a tensor exactly once (a bug or an unsupported sharding)."""


@dataclass(frozen=True, order=True)
class Box:
    """A sub-block of a tensor: `offset` and `size` per dim (a 0-d tensor: both empty)."""

    offset: tuple[int, ...]
    size: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    def is_rows(self, shape: tuple[int, ...]) -> bool:
        """Only dim 0 is cut: the box is one contiguous run of the tensor's bytes."""
        return len(shape) <= 1 or (self.size[1:] == tuple(shape[1:]) and not any(self.offset[1:]))


def full_box(shape: Sequence[int]) -> Box:
    return Box(tuple(0 for _ in shape), tuple(int(d) for d in shape))


def _check_cover(name: str, shape: tuple[int, ...], boxes: Sequence[Box]) -> None:
    """The distinct boxes tile the tensor: inside it, disjoint, together its whole volume."""
    for b in boxes:
        if (
            len(b.offset) != len(shape)
            or len(b.size) != len(shape)
            or any(o < 0 or s < 0 or o + s > d for o, s, d in zip(b.offset, b.size, shape))
        ):
            raise AssignError(f"{name}: box offset {b.offset} size {b.size} lies outside shape {shape}")
    if sum(b.numel for b in boxes) != math.prod(shape):
        raise AssignError(
            f"{name}: the ranks' shards hold {sum(b.numel for b in boxes)} of its "
            f"{math.prod(shape)} elements (shape {shape})"
        )
    if all(b.is_rows(shape) for b in boxes):
        ordered = sorted(boxes)
        for a, b in zip(ordered, ordered[1:]):
            if a.offset[0] + a.size[0] > b.offset[0]:
                raise AssignError(f"{name}: shards overlap at row {b.offset[0]}")
        return
    for i, a in enumerate(boxes):  # other cuts are rare and have few boxes
        for b in boxes[i + 1 :]:
            if all(
                max(ao, bo) < min(ao + asz, bo + bsz) for ao, asz, bo, bsz in zip(a.offset, a.size, b.offset, b.size)
            ):
                raise AssignError(f"{name}: shards {a} and {b} overlap")


def assign_writers(
    holdings: Sequence[Mapping[str, Box]],
    shapes: Mapping[str, tuple[int, ...]],
    itemsize: Mapping[str, int] | None = None,
) -> list[list[tuple[str, Box]]]:
    """Per rank, the (tensor name, box) pairs it writes.

    `holdings[r]` maps tensor names to the non-empty box rank r holds; `shapes` gives every
    tensor to export, in the order to assign them. Each distinct box goes to one holder: the one
    with the fewest bytes assigned so far (ties: the lowest rank), so the result depends only on
    the inputs. Raises AssignError when a tensor's boxes do not cover it exactly once.
    """
    load = [0] * len(holdings)
    out: list[list[tuple[str, Box]]] = [[] for _ in holdings]
    for name, shape in shapes.items():
        shape = tuple(shape)
        holders: dict[Box, list[int]] = {}
        for rank, held in enumerate(holdings):
            box = held.get(name)
            if box is not None and box.numel:
                holders.setdefault(box, []).append(rank)
        if math.prod(shape) == 0:
            continue  # nothing to write: the header alone describes it
        boxes = sorted(holders)
        _check_cover(name, shape, boxes)
        size = (itemsize or {}).get(name, 1)
        for box in boxes:
            rank = min(holders[box], key=lambda r: (load[r], r))
            load[rank] += box.numel * size
            out[rank].append((name, box))
    return out


def box_runs(shape: tuple[int, ...], box: Box) -> tuple[int, int, int]:
    """(number of runs, elements per run, k): the box is `n` contiguous runs of the row-major
    tensor, one per index of dims [0, k) inside the box, in the box's own row-major order."""
    shape = tuple(shape)
    if not shape:
        return 1, 1, 0
    k = len(shape) - 1
    while k > 0 and box.size[k] == shape[k] and box.offset[k] == 0:
        k -= 1
    # dims after k are whole: a run spans box.size[k] x the rest
    return math.prod(box.size[:k]), box.size[k] * math.prod(shape[k + 1 :]), k


def run_starts(shape: tuple[int, ...], box: Box) -> list[int]:
    """Element offset in the full tensor where each run of `box` starts (box_runs' order)."""
    n, _, k = box_runs(shape, box)
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    base = sum(o * s for o, s in zip(box.offset, strides))
    if k == 0:
        return [base]
    starts = []
    for j in range(n):
        rest, delta = j, 0
        for d in reversed(range(k)):  # j as a mixed-radix index over dims [0, k) of the box
            rest, i = divmod(rest, box.size[d])
            delta += i * strides[d]
        starts.append(base + delta)
    return starts


@dataclass(frozen=True)
class Piece:
    """Elements [local_start, local_end) of a rank's box (counted in the box's own row-major order,
    as its local shard holds them) are elements [out_start, out_start + local_end - local_start)
    of an output tensor."""

    local_start: int
    local_end: int
    out_start: int


def take_pieces(
    shape: Sequence[int], box: Box, span: tuple[int, int] | None = None, starts: Sequence[int] | None = None
) -> list[Piece]:
    """Where the elements of `box` (a block of a source tensor of `shape`) land in an output that is
    the source's elements [span) in row-major order (`layout.Take`; None: the whole source).

    The box is `box_runs` runs of the source's flat elements (`starts`: their `run_starts`, passed
    when several outputs take from one box); each run's overlap with the span is one piece, at its
    offset from the span's start in the output. Pieces that continue each other in both the box and
    the output are joined (a dim-0 shard gives at most one piece per output). An output
    transformers 5 splits off a fused MoE tensor (expert e of `[E, R, C]`: elements
    [e*R*C, (e+1)*R*C)) takes from every box that holds part of that expert."""
    shape = tuple(int(d) for d in shape)
    total = math.prod(shape)
    a, b = (0, total) if span is None else (int(span[0]), int(span[1]))
    if not 0 <= a <= b <= total:
        raise AssignError(f"elements [{a}, {b}) lie outside a tensor of shape {list(shape)}")
    if not box.numel or a == b:
        return []
    _, run_len, _ = box_runs(shape, box)
    starts = run_starts(shape, box) if starts is None else starts
    out: list[Piece] = []
    # runs start in increasing order: only those from the last one starting at or before `a` on
    for j in range(max(0, bisect.bisect_right(starts, a) - 1), len(starts)):
        start = starts[j]
        if start >= b:
            break
        lo, hi = max(start, a), min(start + run_len, b)
        if lo >= hi:
            continue
        local = j * run_len + lo - start
        last = out[-1] if out else None
        if (
            last is not None
            and last.local_end == local
            and last.out_start + (last.local_end - last.local_start) == lo - a
        ):
            out[-1] = Piece(last.local_start, local + hi - lo, last.out_start)
        else:
            out.append(Piece(local, local + hi - lo, lo - a))
    return out
