"""The scale bench's I/O floor and what the disk allows when a merge reads and writes at once."""

from __future__ import annotations

from scripts.bench import scale


def test_the_section_says_what_reading_and_writing_at_once_allows():
    """The floor adds a read and a write each at its best; the disk's speed doing both at once, as
    the merge does, is shown beside it, from the run's own measurements."""
    gb = scale.GB
    result = {
        "rows": [{"tool": scale.SINGLE, "walls": [60.0, 64.0, 70.0], "read_bytes": 32 * gb, "written_bytes": 16 * gb}],
        "disk_measurements": [{"mixed_bytes_per_s": 0.6 * gb}, {"mixed_bytes_per_s": 0.8 * gb}, {}],
    }
    result["rows"][0]["io_floor_s"] = 40.0
    words = scale._mixed_words(result)
    assert "0.60-0.80 GB/s combined" in words and "48.0 GB" in words
    assert "take 60 s, 1.50x the I/O floor" in words and "took 64 s (median)" in words
    assert scale._mixed_words({**result, "disk_measurements": [{}]}) == ""


def test_the_floor_takes_the_faster_path_of_each_direction_over_the_run():
    """The merge reads through the page cache: a floor from O_DIRECT alone (one request at a time)
    would be easy to beat, so each direction's floor is its faster path at its best in the run."""
    gb = scale.GB

    def disk(buffered_read, direct_read, buffered_write, direct_write):
        return {
            "write_bytes_per_s": max(buffered_write, direct_write) * gb,
            "read_bytes_per_s": max(buffered_read, direct_read) * gb,
            "size_bytes": 2**30,
            "buffered_write_bytes_per_s": buffered_write * gb,
            "buffered_read_bytes_per_s": buffered_read * gb,
            "direct_write_bytes_per_s": direct_write * gb,
            "direct_read_bytes_per_s": direct_read * gb,
        }

    row = {"tool": scale.SINGLE, "walls": [50.0], "read_bytes": 32 * gb, "written_bytes": 16 * gb}
    result = {"disk_measurements": [disk(3.2, 1.0, 0.5, 0.6), disk(2.5, 1.1, 0.8, 0.4)], "rows": [row]}
    scale.refloor(result)
    assert abs(row["io_floor_s"] - (32 / 3.2 + 16 / 0.8)) < 1e-9
    assert result["floor"] == scale.FLOOR


def test_the_section_says_where_the_single_merges_wall_went():
    """The writer's own timings split the wall: casting (with its page-fault reads) against a cold read
    alone in the same run, the last writes and fsyncs, and the rest (Python, imports, plan, commit)."""
    gb = scale.GB
    stats = [{"wall_s": 28.0, "cast_s": 21.4, "close_s": 0.5}, {"wall_s": 30.0, "cast_s": 23.3, "close_s": 0.8}]
    row = {"tool": scale.SINGLE, "walls": [34.0, 35.0], "read_bytes": 32.1 * gb, "writer_stats": stats}
    result = {
        "rows": [row],
        "disk_measurements": [{"buffered_read_bytes_per_s": 2.2 * gb}, {"buffered_read_bytes_per_s": 2.5 * gb}],
    }
    words = scale._writer_words(result)
    assert "the writer ran 28.0-30.0 s" in words and "took 21.4-23.3 s (1.38-1.50 GB/s of rank files" in words
    assert "moved 2.50 GB/s at best" in words and "after the last chunk 0.5-0.8 s" in words
    assert "the other 5.0-6.0 s" in words
    # a run that did not record them (an older JSON), or recorded fewer than it ran, says nothing
    assert scale._writer_words({**result, "rows": [{**row, "writer_stats": []}]}) == ""
    assert scale._writer_words({**result, "rows": [{**row, "writer_stats": stats[:1]}]}) == ""


def test_the_distributed_merge_is_held_to_one_and_a_half_times_its_floor():
    """The single merge's target stays 1.3x; the distributed merge's is 1.5x."""
    gb = scale.GB

    def row(tool: str) -> dict:
        return {"tool": tool, "walls": [14.0], "peaks": [100 * scale.MiB], "io_floor_s": 10.0, "read_bytes": gb}

    text = scale.targets({"rows": [row(scale.SINGLE), row(scale.DISTRIBUTED)]})
    assert f"| {scale.SINGLE}: wall at most 1.3x the I/O floor | **no** |" in text
    assert f"| {scale.DISTRIBUTED}: wall at most 1.5x the I/O floor | yes |" in text
