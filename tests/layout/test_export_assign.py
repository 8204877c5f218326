"""layout/export_assign (pure): which rank writes which rows of the gather-free export, and the runs and pieces a
box of a tensor covers."""

from __future__ import annotations

import pytest

from slimckpt.layout.export_assign import (
    AssignError,
    Box,
    Piece,
    assign_writers,
    box_runs,
    full_box,
    run_starts,
    take_pieces,
)


def rows(start: int, n: int, shape: tuple[int, ...]) -> Box:
    return Box((start,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:]))


def test_fsdp_row_shards_each_written_by_their_holder():
    shapes = {"w": (10, 4), "b": (3,)}
    holdings = [{"w": rows(0, 5, (10, 4)), "b": rows(0, 2, (3,))}, {"w": rows(5, 5, (10, 4)), "b": rows(2, 1, (3,))}]
    out = assign_writers(holdings, shapes)
    assert out == [
        [("w", rows(0, 5, (10, 4))), ("b", rows(0, 2, (3,)))],
        [("w", rows(5, 5, (10, 4))), ("b", rows(2, 1, (3,)))],
    ]


def test_uneven_and_empty_shards():
    """FSDP's chunking: a 3-row tensor over 4 ranks gives 1,1,1,0 rows; the empty one writes nothing."""
    shapes = {"n": (3, 2)}
    holdings = [{"n": rows(i, 1, (3, 2))} for i in range(3)] + [{}]
    out = assign_writers(holdings, shapes)
    assert [len(s) for s in out] == [1, 1, 1, 0]


def test_replicated_tensor_is_written_once_and_balanced():
    shapes = {f"t{i}": (4, 4) for i in range(4)}
    holdings = [{n: full_box(s) for n, s in shapes.items()} for _ in range(2)]
    out = assign_writers(holdings, shapes)
    written = sorted(n for share in out for n, _ in share)
    assert written == sorted(shapes)  # every tensor exactly once
    assert [len(s) for s in out] == [2, 2]  # spread over the holders by bytes


def test_two_d_mesh_replicas_write_each_row_range_once():
    """(ddp=2, fsdp=2): ranks 0,2 hold rows [0,4), ranks 1,3 rows [4,8); each range once, by bytes."""
    shape = (8, 16)
    holdings = [{"w": rows(0, 4, shape)}, {"w": rows(4, 4, shape)}, {"w": rows(0, 4, shape)}, {"w": rows(4, 4, shape)}]
    out = assign_writers(holdings, {"w": shape})
    boxes = sorted(b for share in out for _, b in share)
    assert boxes == [rows(0, 4, shape), rows(4, 4, shape)]
    assert out[0] and out[1] and not out[2] and not out[3]


def test_gaps_and_overlaps_are_refused():
    shape = (10, 2)
    with pytest.raises(AssignError, match="hold 16 of its 20"):
        assign_writers([{"w": rows(0, 4, shape)}, {"w": rows(6, 4, shape)}], {"w": shape})
    with pytest.raises(AssignError, match="overlap"):
        assign_writers([{"w": rows(0, 6, shape)}, {"w": rows(4, 4, shape)}], {"w": shape})
    with pytest.raises(AssignError, match="outside"):
        assign_writers([{"w": rows(8, 4, shape)}], {"w": shape})


def test_zero_size_tensor_needs_no_writer():
    assert assign_writers([{}, {}], {"empty": (0, 4)}) == [[], []]


def test_box_runs_rows_and_column_shards():
    shape = (4, 6)
    assert box_runs(shape, rows(1, 2, shape)) == (1, 12, 0)
    assert run_starts(shape, rows(1, 2, shape)) == [6]
    col = Box((0, 3), (4, 3))  # Shard(1): one run per row
    assert box_runs(shape, col) == (4, 3, 1)
    assert run_starts(shape, col) == [3, 9, 15, 21]
    assert box_runs((), Box((), ())) == (1, 1, 0)
    # 3-d, cut in dim 1: runs over dim 0 x the box's dim-1 range... dims after 1 whole
    assert box_runs((2, 4, 5), Box((0, 2, 0), (2, 2, 5))) == (2, 10, 1)
    assert run_starts((2, 4, 5), Box((0, 2, 0), (2, 2, 5))) == [10, 30]


def test_box_runs_cover_the_box_exactly():
    """Every element of a box, in the box's row-major order, is where box_runs/run_starts put it."""
    import itertools
    import math

    shape = (3, 4, 5)
    box = Box((1, 1, 2), (2, 3, 2))
    n, length, _ = box_runs(shape, box)
    got = [s + i for s in run_starts(shape, box) for i in range(length)]
    strides = [math.prod(shape[d + 1 :]) for d in range(3)]
    want = [
        sum((o + i) * st for o, i, st in zip(box.offset, idx, strides))
        for idx in itertools.product(*(range(s) for s in box.size))
    ]
    assert n * length == box.numel and got == want


def _box_elements(shape, box):
    """The flat source index of each element of `box`, in the box's own row-major order."""
    import itertools
    import math

    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    return [
        sum((o + i) * st for o, i, st in zip(box.offset, idx, strides))
        for idx in itertools.product(*(range(s) for s in box.size))
    ]


def _tilings(shape):
    """Ways FSDP (or a test of it) cuts a tensor: dim-0 rows (uneven, one rank empty), dim-1
    columns, dim-2 blocks, a 2x2 grid, and whole (replicated)."""
    e, r, c = shape
    yield [Box((0, 0, 0), (2, r, c)), Box((2, 0, 0), (e - 2, r, c)), Box((e, 0, 0), (0, r, c))]
    yield [Box((0, 0, 0), (e, 3, c)), Box((0, 3, 0), (e, r - 3, c))]
    yield [Box((0, 0, 0), (e, r, 2)), Box((0, 0, 2), (e, r, c - 2))]
    yield [
        Box((0, 0, 0), (1, 2, c)),
        Box((0, 2, 0), (1, r - 2, c)),
        Box((1, 0, 0), (e - 1, 2, c)),
        Box((1, 2, 0), (e - 1, r - 2, c)),
    ]
    yield [full_box(shape)]


def test_take_pieces_put_every_element_of_every_expert_where_it_belongs():
    """A fused [E, 2I, H] tensor split per expert into gate and up halves (and a whole-tensor
    output): for every way of cutting the source into ranks' boxes, the pieces of all boxes write
    each output element exactly once, with the source element the span says it is."""
    shape = (3, 6, 5)  # 3 experts, 2I = 6 rows, H = 5
    per_expert, half = 6 * 5, 3 * 5
    spans = [(e * per_expert + h * half, e * per_expert + (h + 1) * half) for e in range(3) for h in range(2)]
    spans += [(0, 90), (7, 53)]  # the whole tensor; a run that starts and ends inside rows
    for boxes in _tilings(shape):
        for a, b in spans:
            got: dict[int, int] = {}
            for box in boxes:
                elements = _box_elements(shape, box)
                for p in take_pieces(shape, box, (a, b)):
                    for i in range(p.local_end - p.local_start):
                        out = p.out_start + i
                        assert out not in got, (boxes, a, b, out)
                        got[out] = elements[p.local_start + i]
            assert got == {i: a + i for i in range(b - a)}, (boxes, a, b)


def test_take_pieces_joins_runs_and_skips_what_it_does_not_need():
    shape = (4, 6)
    # a dim-0 shard: one piece per output, whatever its span
    assert take_pieces(shape, rows(1, 2, shape), (8, 20)) == [Piece(2, 12, 0)]  # elements 8..18
    assert take_pieces(shape, rows(1, 2, shape), None) == [Piece(0, 12, 6)]
    # columns 3..5: one piece per row the span touches; adjacent rows do not continue in the output
    col = Box((0, 3), (4, 3))
    assert take_pieces(shape, col, (6, 18)) == [Piece(3, 6, 3), Piece(6, 9, 9)]
    assert take_pieces(shape, col, (0, 3)) == []  # the span lies in columns the box does not hold
    assert take_pieces(shape, Box((0, 0), (0, 6)), (0, 6)) == []
    with pytest.raises(AssignError, match="outside"):
        take_pieces(shape, col, (20, 30))
