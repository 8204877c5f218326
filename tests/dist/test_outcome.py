"""slimckpt.dist.outcome on a real 2-rank gloo group: every rank ends the same way."""

from __future__ import annotations

import errno
import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from slimckpt.dist.outcome import Failure, agree, first, from_rank0, on_every_rank


class Boom(RuntimeError):
    pass


def _error(f: Failure) -> Boom:
    return Boom(f"rank {f.rank}: {f.line}")


def _worker(rank: int, world: int, store_path: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    out = []

    # each rank's part; rank 1 fails with an OS error: every rank raises rank 1's line, with its errno
    def part():
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/x")
        return rank * 10

    try:
        on_every_rank(None, part, _error)
        out.append("no error")
    except Boom as exc:
        out.append(f"{exc}|{exc.__cause__.errno if exc.__cause__ else None}")
    out.append(str(on_every_rank(None, lambda: rank + 1, _error)))
    # rank 0 plans, every rank gets the plan
    out.append(str(from_rank0(None, lambda: {"plan": rank}, _error)))
    try:
        from_rank0(None, lambda: (_ for _ in ()).throw(ValueError("no plan")), _error)
    except Boom as exc:
        out.append(str(exc))
    # recorded outcomes: the lowest order wins over the lowest rank
    mine = Failure(rank, f"damaged file {2 - rank}", order=2 - rank)
    try:
        agree(None, mine, _error)
    except Boom as exc:
        out.append(str(exc))
    agree(None, None, _error)
    out.append("agreed")
    dist.destroy_process_group()
    with open(os.path.join(results, str(rank)), "w") as f:
        f.write("\n".join(out))


@pytest.mark.slow
def test_every_rank_raises_the_same_first_failure(tmp_path):
    results = tmp_path / "out"
    results.mkdir()
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), str(results)), nprocs=2, join=True)
    got = [(results / str(r)).read_text().splitlines() for r in range(2)]
    assert got[0][0] == got[1][0] == f"rank 1: [Errno {errno.ENOSPC}] No space left on device: '/ckpt/x'|{errno.ENOSPC}"
    assert [g[1] for g in got] == ["1", "2"]
    assert got[0][2] == got[1][2] == "{'plan': 0}"
    assert got[0][3] == got[1][3] == "rank 0: no plan"
    assert got[0][4] == got[1][4] == "rank 1: damaged file 1"
    assert got[0][5] == got[1][5] == "agreed"


def test_without_a_group_the_step_runs_alone():
    assert on_every_rank(None, lambda: 3, _error) == 3
    assert from_rank0(None, lambda: "v", _error) == "v"

    def bad():
        raise ZeroDivisionError("division by zero")

    with pytest.raises(Boom, match="rank 0: division by zero") as info:
        on_every_rank(None, bad, _error)
    assert info.value.__cause__ is None
    assert first([None, Failure(3, "a", order=1), Failure(2, "b", order=1)]).rank == 2
    assert first([None, None]) is None
