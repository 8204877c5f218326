"""scripts/bench/scale_report.py: BENCHMARKS.md's scale section and README's headline row are the committed JSON
rendered, byte for byte; the I/O floor each row is held to; what the section says of the disk, of the single merge's
wall, of a merge killed midway, and of verl's merger killed or not."""

from __future__ import annotations

import copy
import json

from scripts.bench import scale_report as scale
from tests.helpers.launch import REPO


def _committed() -> dict:
    return json.loads((REPO / "docs" / "bench_scale.json").read_text())


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


def test_committed_section_and_headline_are_the_committed_json_rendered():
    result = _committed()
    section = scale.render_section(result)
    assert section.strip() in (REPO / "BENCHMARKS.md").read_text()
    block, readme = scale.readme_block(result), (REPO / "README.md").read_text()
    if block is None:  # a run below the headline's size leaves README's block as it is
        assert result["build"]["params"] < scale.HEADLINE_PARAMS
    else:
        assert block.strip() in readme
    # what the section claims follows from the JSON: the floor ratio of each tool's median wall
    for row in result["rows"]:
        ratio = scale.floor_ratio(scale.median(row["walls"]), row["io_floor_s"])
        assert f"| {ratio} |" in section
    assert section.startswith(scale.BEGIN) and section.rstrip().endswith(scale.END)


def test_the_killed_merge_is_reported_and_a_complete_looking_leftover_fails_its_target():
    result = _committed()
    found = {
        "kill_after_s": 23.0,
        "killed": True,
        "killed_at_s": 23.0,
        "returncode": -9,
        "target_exists": False,
        "partial_files": 3,
        "partial_bytes": 7 * 10**9,
        "partial_manifest": False,
        "verify_after_kill": {"returncode": 1, "said": "no checkpoint at merged"},
        "rerun_returncode": 0,
        "rerun_wall_s": 48.0,
        "rerun_tail": "",
        "partial_after_rerun": False,
        "verify_after_rerun": {"returncode": 0, "said": "ok"},
    }
    section = scale.render_section({**result, "killed_midway": found})
    assert "SIGKILLed 23 s into its run" in section and "7.0 GB" in section
    assert "| slimckpt merge killed midway: leaves nothing that looks complete | yes |" in section
    assert "| slimckpt merge killed midway: the same command again finishes and verifies | yes |" in section
    bad = scale.render_section({**result, "killed_midway": {**found, "target_exists": True}})
    assert "| slimckpt merge killed midway: leaves nothing that looks complete | **no** |" in bad
    # a merge that finished before its kill, and a run that did not try one (an older JSON)
    early = scale.render_section({**result, "killed_midway": {**found, "killed": False}})
    assert "finished before that" in early and "killed midway: leaves nothing" in early
    older = {k: v for k, v in result.items() if k != "killed_midway"}
    assert "killed midway" not in scale.render_section(older)


def test_verl_killed_is_judged_by_its_rate_on_the_smaller_checkpoint_and_unkilled_by_its_own_peak():
    result = copy.deepcopy(_committed())
    result["verl"].update(killed=True, killed_at_s=300.0, peak_rss_anon=18 * scale.GiB)
    result["verl_reference"].update(per_shard_byte=2.0)
    assert scale.verl_needs(result) == 2.0 * result["build"]["shard_bytes"]
    assert "killed at 300 s" in scale.table(result) and "killed at 300 s when its anonymous RSS" in scale.verl_words(
        result
    )
    result["verl"].update(killed=False, killed_at_s=None, wall_s=90.0, peak_rss_anon=5 * scale.GiB)
    assert scale.verl_needs(result) == 5 * scale.GiB
    assert "finished under the cap" in scale.table(result)
    assert "not killed: it finished in 90 s at a peak of 5.0 GiB" in scale.verl_words(result)
    assert "5.0 GiB, 90 s" in scale.readme_block(result)


def test_readme_row_only_for_a_model_of_the_headline_size_and_its_link_is_the_sections_anchor():
    result = copy.deepcopy(_committed())
    block = scale.readme_block(result)
    assert block.startswith(scale.README_BEGIN) and block.endswith(scale.README_END)
    heading = next(ln for ln in scale.render_section(result).splitlines() if ln.startswith("## "))
    # GitHub's anchor: lower case, punctuation dropped, spaces to dashes
    assert f"(BENCHMARKS.md#{scale._anchor(result)})" in block
    assert scale._anchor(result) == "".join(c for c in heading[3:].lower() if c.isalnum() or c in " -").replace(
        " ", "-"
    )
    result["build"]["params"] = scale.HEADLINE_PARAMS - 1
    assert scale.readme_block(result) is None
    assert scale._article("8.0") == "an" and scale._article("11") == "an" and scale._article("3.2") == "a"


def test_an_unnamed_preset_is_named_by_its_size_and_a_note_closes_the_section():
    result = {**_committed(), "preset": "1b", "note": "One run only: the host was shared."}
    result["build"] = {**result["build"], "params": 1.24e9}
    section = scale.render_section(result)
    assert "## At scale: a 1.24B Llama checkpoint (fp32" in section
    assert section.endswith("One run only: the host was shared.\n" + scale.END + "\n")
