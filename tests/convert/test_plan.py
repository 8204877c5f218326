"""convert/plan (pure): the rows and flat runs each rank of the target world size holds, as torch's chunk and
FSDP1's flat shard lay them out."""

from __future__ import annotations

from slimckpt.convert import plan


def test_rows_follow_torch_chunk():
    import torch

    for rows in (0, 1, 5, 16, 17):
        for world in (1, 2, 3, 4, 7):
            chunks = [c.shape[0] for c in torch.arange(rows).chunk(world)] if rows else []
            got = [plan.row_range(rows, world, r) for r in range(world)]
            sizes = [b - a for a, b in got]
            assert sizes[: len(chunks)] == chunks and not any(sizes[len(chunks) :]), (rows, world, got)
            assert got[0][0] == 0 and all(got[i][1] == got[i + 1][0] for i in range(world - 1))


def test_flat_runs_cover_every_element_once():
    numels = [7, 1, 12, 5]
    for world in (1, 2, 3, 5):
        seen = [[] for _ in numels]
        size = plan.flat_shard(sum(numels), world)
        for rank in range(world):
            for i, a, b, at in plan.flat_runs(numels, world, rank):
                assert 0 <= at and at + b - a <= size
                seen[i].append((a, b))
        for i, n in enumerate(numels):
            assert sorted(seen[i])[0][0] == 0 and sum(b - a for a, b in seen[i]) == n
