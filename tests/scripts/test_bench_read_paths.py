"""The read-path bench's order of reads and its table (no disk timed here)."""

from __future__ import annotations

from scripts.bench import read_paths as rp


def test_the_reads_follow_the_merge_tensor_by_tensor_then_rank_by_rank():
    """Each tensor's shards come from every rank file in turn, cut into the merge's chunks."""
    pieces = [rp.Piece(0, 100, 5, "float32"), rp.Piece(1, 100, 5, "float32"), rp.Piece(0, 105, 3, "float32")]
    assert rp.chunks(pieces, chunk=2) == [
        (0, 100, 2, "float32"),
        (0, 102, 2, "float32"),
        (0, 104, 1, "float32"),
        (1, 100, 2, "float32"),
        (1, 102, 2, "float32"),
        (1, 104, 1, "float32"),
        (0, 105, 2, "float32"),
        (0, 107, 1, "float32"),
    ]


def _result() -> rp.Result:
    result = rp.Result("/c", 8, 4 * 10**9, rp.CHUNK, rp.AHEAD, "abc1234", "2026-12-05 12:00 UTC", "python -m x")
    for path, seconds in [("mmap", 4.0), ("mmap", 5.0), ("mmap", 2.0), ("readinto+thread", 2.0), ("cold read", 1.0)]:
        result.runs.append(rp.PathRun(path, seconds, 4 * 10**9, 1.5))
    return result


def test_each_path_is_its_median_against_the_memory_map():
    rows = {row["path"]: row for row in rp.summary(_result())}
    assert rows["mmap"]["runs"] == 3 and rows["mmap"]["median_gbps"] == 1.0
    assert (rows["mmap"]["min_gbps"], rows["mmap"]["max_gbps"]) == (0.8, 2.0)
    assert rows["readinto+thread"]["vs_mmap"] == 2.0 and rows["cold read"]["vs_mmap"] == 4.0
    assert [row["path"] for row in rp.summary(_result())] == ["mmap", "readinto+thread", "cold read"]


def test_the_table_round_trips_through_its_json():
    result = _result()
    again = rp.from_json(rp.to_json(result))
    assert again == result
    text = rp.render(again)
    assert text.startswith(rp.BEGIN) and text.endswith(rp.END)
    assert "`python -m x`, commit abc1234" in text and rp.render([again, again]).count("| mmap | 3 |") == 2
    assert "| mmap | 3 | 1.00 | 0.80-2.00 | 1.00x | 1.5, 1.5, 1.5 |" in text
