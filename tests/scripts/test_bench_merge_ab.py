"""scripts/bench/merge_ab.py: the A/B table from a run's JSON (medians, spreads, the writer's split)."""

from __future__ import annotations

import json

import pytest

from scripts.bench import merge_ab


def _run(wall: float, peak_mib: float, cast: float) -> dict:
    return {
        "wall_s": wall,
        "peak": peak_mib * 2**20,
        "load": 1.5,
        "writer": {"wall_s": wall - 3, "cast_s": cast, "close_s": 0.5},
    }


def test_the_table_gives_each_trees_medians_and_spread(tmp_path, capsys):
    result = {
        "command": "python -m scripts.bench.merge_ab ...",
        "date": "2026-12-05 19:00 UTC",
        "ckpt": "/c",
        "trees": {"A": {"path": "/old", "label": "through the page cache"}, "B": {"path": ".", "label": "O_DIRECT"}},
        "runs": {
            "A": [_run(30, 279, 0), _run(40, 280, 0), _run(33, 279, 0)],
            "B": [_run(13, 285, 8), _run(15, 285, 9)],
        },
    }
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(result))
    assert merge_ab.main(["--render", str(path)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[2].startswith(
        "| through the page cache | 3 | 33.0 s | 30.0-40.0 s | 30.0 s | 0.0 s | 0.5 s | 280 MiB |"
    )
    assert rows[3].startswith("| O_DIRECT | 2 | 14.0 s | 13.0-15.0 s | 11.0 s | 8.5 s | 0.5 s | 285 MiB |")


def test_a_run_needs_a_checkpoint_and_tree_a(capsys):
    with pytest.raises(SystemExit) as exc:
        merge_ab.main([])
    assert exc.value.code == 2
    assert "--ckpt and --a" in capsys.readouterr().err
