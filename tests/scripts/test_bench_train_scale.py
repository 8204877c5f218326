"""scripts/bench/train_scale_report.py (no runs): a killed run is reported as killed, in what and how far
in, with what verl's path needs; the targets follow the numbers; README's rows and BENCHMARKS' section
are replaced between their markers only; the timeline picture is cut to the first save."""

from __future__ import annotations

from scripts.bench import plots
from scripts.bench import train_scale_report as ts
from scripts.bench.save_report import write_section

MiB, GiB = 2**20, 2**30


def _saved(mode, extra_mib, wall, load=None, preset="big"):
    row = {
        "preset": preset,
        "mode": mode,
        "killed": False,
        "killed_at_s": None,
        "tree_peak": 15 * GiB,
        "timeline": [(t, (14 + (t > 10)) * GiB) for t in range(0, 40)],
        "events": {"built": 5.0, "save-1": 10.0, "saved-1": 30.0},
        "params": 3.6e9,
        "save_extra_per_rank": [extra_mib * MiB, extra_mib * MiB // 2],
        "walls": [wall],
        "blockings": [wall],
        "wall_s": wall,
        "blocking_s": wall,
        "bytes_on_disk": 29e9,
        "hf_safetensors": 3,
    }
    if load:
        row["load"] = {"extra_per_rank": [load[0] * MiB, load[0] * MiB], "wall_s": load[1], "equal": load[2]}
    return row


def _killed(mode, at, event="save-1", preset="big"):
    return {
        "preset": preset,
        "mode": mode,
        "killed": True,
        "killed_at_s": at,
        "tree_peak": 18 * GiB,
        "timeline": [(t, (14 + t / 10) * GiB) for t in range(0, int(at))],
        "events": {"built": 5.0, event: 10.0},
        "killed_in": event,
        "killed_after_s": at - 10.0,
    }


def _result(rows, resume_ref="small"):
    return {
        "rows": rows,
        "meta": {
            "command": "python -m scripts.bench.train_scale",
            "date": "2026-01-01",
            "commit": "abc1234",
            "seconds": 600.0,
            "machine": "test",
            "available_gib": 20.0,
            "cap": 18 * GiB,
            "cap_note": "",
            "preset": "big",
            "shape": "28 layers",
            "params": 3.6e9,
            "resume_ref": resume_ref,
            "repeats": 2,
        },
    }


def _rows(ours_save=10, ours_load=(40, 20.0, True), ref_load=(40, 5.0, True), verl_ref_wall=6.0):
    return [
        _killed("verl", 41.0),
        _saved("intermediate", 8, 30.0),
        _saved("incremental", ours_save, 45.0, load=ours_load),
        _saved("stream", 12, 44.0),
        _killed("verl-resume", 60.0, event="load"),
        _saved("verl-resume", 1, 10.0, load=(7000, verl_ref_wall, True), preset="small"),
        _saved("incremental", 5, 5.0, load=ref_load, preset="small"),
    ]


def test_a_killed_run_says_where_and_what_verl_needs():
    section = ts.render_section(_result(_rows()))
    assert (
        "| verl 0.9.1 (`hf_model`) | killed 31 s into the save: its `hf_model` save gathers the whole fp32 model (14.4 GB) on rank 0"
        in section
    )
    assert "killed 50 s into the load: its load reads each rank's whole shard file (7.2 GB)" in section
    assert "| `+recipe=incremental` | 10 MiB / 5 MiB | 15.0 GiB | 45.0 s |" in section


def test_targets_follow_the_numbers():
    ok = {name: met for name, met, _ in ts.targets(_result(_rows()))}
    assert all(ok.values()), ok
    worse = {name: met for name, met, _ in ts.targets(_result(_rows(ours_save=65, verl_ref_wall=4.0)))}
    assert not worse["`+recipe=incremental` save: extra RssAnon <= 64 MiB per rank (big)"]
    assert not worse["incremental load wall <= verl's (small)"]
    assert worse["incremental load wall <= verl's (big)"]  # verl's load was killed there
    changed = {name: met for name, met, _ in ts.targets(_result(_rows(ours_load=(40, 20.0, False))))}
    assert not changed["incremental load: extra RssAnon <= one bucket (64 MiB) + 64 MiB per rank, shards equal (big)"]
    big_load = {name: met for name, met, _ in ts.targets(_result(_rows(ours_load=(129, 20.0, True))))}
    assert not big_load["incremental load: extra RssAnon <= one bucket (64 MiB) + 64 MiB per rank, shards equal (big)"]


def test_readme_and_report_are_replaced_between_markers_only(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{ts.README_BEGIN}\nold row\n{ts.README_END}\nafter\n")
    ts.write_readme(_result(_rows()), readme)
    text = readme.read_text()
    assert text.startswith("# x\n\nbefore\n") and text.endswith(f"{ts.README_END}\nafter\n")
    assert "old row" not in text
    assert (
        "| killed 31 s into the save at 18 GiB for the job (`hf_model`) | 10 MiB, 45.0 s (`+recipe=incremental`) |"
        in text
    )
    assert "| killed 50 s into the load at 18 GiB for the job | 40 MiB, 20.0 s |" in text
    report = tmp_path / "BENCHMARKS.md"
    report.write_text("# Benchmarks\n\nmerge\n")
    write_section(ts.render_section(_result(_rows())), report)
    write_section(ts.render_section(_result(_rows(ours_save=11))), report)
    text = report.read_text()
    assert text.startswith("# Benchmarks\n\nmerge\n") and text.count(ts.BEGIN) == 1
    assert "| `+recipe=incremental` | 11 MiB / 6 MiB |" in text  # 5.5 MiB rounds to 6


def test_the_timeline_starts_before_the_first_save_and_ends_with_it(tmp_path):
    pts = plots.timeline_points(_result(_rows()))
    assert set(pts) == {"verl", "intermediate", "incremental", "stream"}
    assert pts["incremental"][0][0] == -5 and pts["incremental"][-1][0] == 22  # saved-1 at 30 s, +2 s
    assert pts["verl"][-1][0] <= 31  # killed at 41 s
    plots.plot_timeline(_result(_rows()), tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
