"""scripts/bench/s3_save_report.py (no runs): medians, spread, GB/s and the s3/disk ratio from the rows; each
rank's rise checked against part x concurrency x write_threads + 64 MiB; BENCHMARKS' section replaced between its
markers only."""

from __future__ import annotations

from scripts.bench import s3_save
from scripts.bench import s3_save_report as s3_report
from scripts.bench.save_report import write_section

MiB, GiB, GB = 2**20, 2**30, 10**9


def _row(target, rep, wall, rise_mib, nbytes=14.4e9):
    row = {
        "preset": "llama3.2-3b",
        "target": target,
        "rep": rep,
        "params": 3.61e9,
        "wall_s": wall,
        "ranks_cpu_s": 2 * wall,
        "rise_per_rank": [rise_mib[0] * MiB, rise_mib[1] * MiB],
        "tree_peak": 15 * GiB,
        "files": 7,
        "bytes": nbytes,
        "write_threads": 1,
        "connect_s": 0.2,
        "connect_rise_per_rank": [15 * MiB, 14 * MiB],
    }
    if target == "s3":
        row.update(
            part_bytes=32 * MiB, concurrency=4, server_peak=300 * MiB, server_cpu_s=3 * wall, on_server_disk=nbytes
        )
    return row


def _result(rows, preset="llama3.2-3b", repeat=3):
    return {
        "meta": {
            "command": f"python -m scripts.bench.s3_save --preset {preset} --repeat {repeat}",
            "date": "2026-12-05 07:00 UTC",
            "commit": "abc1234",
            "machine": "x86_64, 2 cores, 24 GiB RAM, torch 2.x",
            "preset": preset,
            "repeat": repeat,
            "repeat_note": "",
            "cap": 18 * GiB,
            "cap_note": "",
            "available_gib": 20.0,
            "part_bytes": 32 * MiB,
            "concurrency": 4,
            "seconds": 600.0,
        },
        "rows": rows,
    }


def _three_pairs(s3_walls=(40.0, 44.0, 42.0), s3_rise=(150, 140)):
    rows = []
    for i, (d, s) in enumerate(zip((36.0, 34.0, 35.0), s3_walls)):
        rows += [_row("disk", i, d, (20, 18)), _row("s3", i, s, s3_rise)]
    return _result(rows)


def test_summary_medians_spread_rate_ratio_and_worst_rise():
    summary = s3_report.summarise(_three_pairs())
    disk, s3 = summary["targets"]["disk"], summary["targets"]["s3"]
    assert (disk["median_s"], disk["min_s"], disk["max_s"], disk["runs"]) == (35.0, 34.0, 36.0, 3)
    assert s3["median_s"] == 42.0
    assert abs(s3["gbps"] - 14.4e9 / 42.0 / GB) < 1e-9
    assert abs(summary["ratio"] - 42.0 / 35.0) < 1e-9
    assert s3["rise_per_rank"] == [150 * MiB, 140 * MiB]
    assert s3["bound"] == 32 * MiB * 4 * 1 + 64 * MiB and s3["within"]
    assert disk["bound"] == 64 * MiB and disk["within"]
    assert s3["server_peak"] == 300 * MiB and s3["connect_rise"] == 15 * MiB


def test_bound_counts_write_threads():
    assert s3_report.bound(32 * MiB, 4, 2) == 256 * MiB + 64 * MiB


def test_section_has_provenance_table_and_targets_met():
    text = s3_report.render_section(_three_pairs())
    assert text.startswith(s3_report.BEGIN) and text.rstrip().endswith(s3_report.END)
    assert "python -m scripts.bench.s3_save --preset llama3.2-3b --repeat 3" in text and "abc1234" in text
    assert (
        "| S3, local SeaweedFS | 42.0 s (40.0–44.0, 3 runs) | 0.34 | 1.20x | 210 (ranks 84, server 126) | 150 MiB / 140 MiB | 192 MiB | yes |"
        in text
    )
    assert "| local disk (fsync) | 35.0 s (34.0–36.0, 3 runs) | 0.41 | - | 70 (ranks) |" in text
    assert "part 32 MiB, concurrency 4, write_threads 1" in text
    checks = s3_report.targets(_three_pairs())
    assert [ok for _n, ok, _v in checks] == [True, True]
    assert "the target is stated at" not in checks[0][0]


def test_slow_upload_and_rise_past_the_bound_are_failed_targets():
    result = _three_pairs(s3_walls=(60.0, 61.0, 59.0), s3_rise=(300, 100))
    (ratio_name, ratio_ok, ratio_value), (mem_name, mem_ok, mem_value) = s3_report.targets(result)
    assert not ratio_ok and ratio_value == "1.71x"
    assert not mem_ok and mem_value == "300 MiB > 192 MiB"
    assert "| 300 MiB / 100 MiB | 192 MiB | NO |" in s3_report.render_section(result)


def test_one_run_per_target_and_a_small_preset_are_said():
    rows = [_row("disk", 0, 2.0, (1, 1), nbytes=1e9), _row("s3", 0, 3.0, (40, 40), nbytes=1e9)]
    for r in rows:
        r["preset"] = "0.25b"
    result = _result(rows, preset="0.25b", repeat=1)
    result["meta"]["repeat_note"] = "Once per target: the time left allowed no more."
    text = s3_report.render_section(result)
    assert "2.0 s (1 run)" in text and "one row per target" in text and "the time left allowed no more" in text
    assert "the target is stated at llama3.2-3b" in text


def test_section_replaced_between_markers_only(tmp_path):
    report = tmp_path / "BENCHMARKS.md"
    report.write_text(f"# Benchmarks\n\nTEXT BEFORE\n\n{s3_report.BEGIN}\nOLD SECTION\n{s3_report.END}\n\nTEXT AFTER\n")
    write_section(s3_report.render_section(_three_pairs()), report)
    text = report.read_text()
    assert "OLD SECTION" not in text and text.count(s3_report.BEGIN) == 1
    assert (
        text.index("TEXT BEFORE") < text.index(s3_report.BEGIN) < text.index(s3_report.END) < text.index("TEXT AFTER")
    )


def test_command_names_the_switches_that_change_a_run():
    args = s3_save.parse_args(["--preset", "0.25b", "--part-mb", "16", "--out", "", "--json", ""])
    assert args.repeat == 3
    assert args.command == "python -m scripts.bench.s3_save --preset 0.25b --repeat 3 --part-mb 16"
    assert s3_save.parse_args([]).repeat == 3


def test_a_run_cut_short_says_how_far_it_got():
    result = _three_pairs()
    result["rows"] = result["rows"][:3]
    result["meta"]["done"] = False
    text = s3_report.render_section(result)
    assert "2 pairs of rows" in text and "cut short: 3 of the 6 rows planned ran" in text


def test_rows_without_cpu_seconds_render_a_dash():
    result = _three_pairs()
    for r in result["rows"]:
        r.pop("ranks_cpu_s")
        r.pop("server_cpu_s", None)
    assert "| 1.20x | - | 150 MiB / 140 MiB |" in s3_report.render_section(result)


def test_where_the_s3_rows_time_went_from_their_cpu_seconds():
    result = _three_pairs()  # s3: ranks 2 x wall, server 3 x wall CPU seconds, 2 cores
    words = s3_report.where_time_went(result)
    assert "kept the host's 2 cores 250% busy" in words
    assert "the server alone spent 8.8 CPU seconds per GB stored (the ranks 5.8)" in words
    assert "at least 63 s with every core on it" in words
    result["meta"]["machine"] = "somewhere"
    assert s3_report.where_time_went(result) == ""
