"""The distributed merge's race points (slimckpt.engine.race_points), the test hook that shakes them, and the
stress run's byte comparison (scripts/stress/merge_bytes.py), which must name the first differing file
and offset when a merge writes other bytes."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from scripts.stress.merge_bytes import CASES, configurations, first_difference
from slimckpt.engine import race_points

from ..conftest import REPO


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_the_first_differing_file_and_offset_are_named(tmp_path):
    body = bytes(range(256)) * 9000  # over 2 MiB: the difference lies past the first read
    ref = _tree(tmp_path / "ref", {"a.json": b"{}", "model-1.safetensors": body, "sub/x": b"1"})
    same = _tree(tmp_path / "same", {"a.json": b"{}", "model-1.safetensors": body, "sub/x": b"1"})
    assert first_difference(same, ref) is None

    changed = bytearray(body)
    changed[(1 << 20) + 12345] ^= 0xFF
    other = _tree(tmp_path / "other", {"a.json": b"{}", "model-1.safetensors": bytes(changed), "sub/x": b"1"})
    diff = first_difference(other, ref)
    assert (diff.file, diff.offset) == ("model-1.safetensors", (1 << 20) + 12345)
    assert "model-1.safetensors: first difference at byte offset 1060921" in diff.line()

    short = _tree(tmp_path / "short", {"a.json": b"{}", "model-1.safetensors": body[:100], "sub/x": b"1"})
    assert first_difference(short, ref).line() == (
        "model-1.safetensors: first difference at byte offset 100 (this output ends there, reference 0x64)"
    )
    missing = _tree(tmp_path / "missing", {"a.json": b"{}", "model-1.safetensors": body})
    assert first_difference(missing, ref).line() == "sub/x: only in the reference"


def test_a_point_sleeps_only_when_the_hook_is_set(monkeypatch):
    monkeypatch.delenv(race_points.DELAY_ENV, raising=False)
    t0 = time.perf_counter()
    for _ in range(1000):
        race_points.pause("write")
    assert time.perf_counter() - t0 < 0.5  # unset: no sleep at all

    slept = []
    monkeypatch.setattr(race_points.time, "sleep", slept.append)
    monkeypatch.setenv(race_points.DELAY_ENV, "0.05")
    for point in race_points.POINTS:
        race_points.pause(point)
    assert len(slept) == len(race_points.POINTS) and all(0 <= s <= 0.05 for s in slept)
    with pytest.raises(ValueError, match="unknown race point 'nowhere'"):
        race_points.pause("nowhere")


def test_every_race_point_is_placed_in_the_merge():
    """Each declared point is paused at somewhere in the package (a point named but never reached would
    leave that ordering unshaken by the stress run)."""
    used = set()
    for path in (REPO / "patches" / "slimckpt").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "pause"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                used.add(node.args[0].value)
    assert used == set(race_points.POINTS)


def test_the_stress_covers_every_case_on_two_and_three_ranks_with_and_without_workers():
    runs = configurations(100)
    assert len(runs) == 100
    assert {(c, r) for c, r, _ in runs} == {(c, r) for c in CASES for r in (2, 3)}
    assert {w for _, _, w in runs} == {1, 2}
    assert {c for c, _, _ in runs} >= {"dense", "deepseek-v3", "qwen3-moe"}
