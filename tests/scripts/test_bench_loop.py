"""scripts/bench/loop.py's report logic (no runs): save reports -> one row per save -> the section."""

from scripts.bench import loop as bench_loop

MiB = 2**20


def _reports(step, blocking, guard=0.0, extra=(10, 20), seconds=1.0, committed=False):
    out = []
    for rank, mib in enumerate(extra):
        out.append(
            {
                "kind": "save",
                "role": "actor",
                "global_step": step,
                "rank": rank,
                "committed": committed,
                "blocking_seconds": blocking,
                "peak_rss_extra_bytes": 1,
                "seconds": seconds,
            }
        )
        if not committed:
            out.append(
                {
                    "kind": "commit",
                    "role": "actor",
                    "global_step": step,
                    "rank": rank,
                    "seconds": seconds,
                    "peak_rss_extra_bytes": mib * MiB,
                    "guard_blocked_seconds": guard,
                    "guard_copied_bytes": rank * MiB,
                }
            )
    return out


def test_blocked_adds_the_guards_wait_and_the_first_save_is_left_out():
    reports = (
        _reports(1, 5.0, 9.0)
        + _reports(2, 0.1, 0.2, seconds=2.0)
        + _reports(3, 0.3, 0.0, extra=(30, 5))
        + [{"kind": "save", "role": "critic", "global_step": 2, "rank": 0}]
    )
    saves = bench_loop.per_save(reports)
    assert [s["step"] for s in saves] == [1, 2, 3]
    assert abs(saves[1]["blocked_s"] - 0.3) < 1e-9 and saves[2]["extra_rss"] == [30 * MiB, 5 * MiB]
    row = bench_loop.summarise("stream", saves)
    assert row["n"] == 2 and abs(row["blocked"]["max"] - 0.3) < 1e-9 and row["extra_rss"]["max"] == 30 * MiB
    assert row["to_commit"] == {"median": 1.5, "min": 1.0, "max": 2.0} and row["guard_copied"] == MiB


def test_a_save_without_its_commit_report_is_not_counted_and_sync_saves_are_their_own_commit():
    reports = _reports(1, 1.0, committed=True) + [r for r in _reports(2, 0.1) if r["kind"] == "save"]
    assert [s["step"] for s in bench_loop.per_save(reports)] == [1]


def test_section_is_replaced_between_its_markers(tmp_path):
    rows = [
        bench_loop.summarise(m, bench_loop.per_save(_reports(1, b) + _reports(2, b, committed=m == "sync")))
        for m, b in (("sync", 2.0), ("stream", 0.02))
    ]
    result = {
        "rows": rows,
        "meta": {
            "command": "python -m scripts.bench.loop",
            "date": "2026-12-01",
            "commit": "abc1234",
            "steps": 2,
            "seconds": 60.0,
            "machine": "test",
            "note": "a note",
        },
    }
    report = tmp_path / "BENCHMARKS.md"
    report.write_text("# Benchmarks\n\nother\n")
    bench_loop.write_section(bench_loop.render_section(result), report)
    bench_loop.write_section(bench_loop.render_section(result), report)
    text = report.read_text()
    assert text.count(bench_loop.BEGIN) == 1 and "other" in text and "abc1234" in text and "a note" in text
    assert "| stream | 1 | 0.020 (0.020-0.020) | 2% |" in text


def test_each_size_has_its_own_section(tmp_path):
    rows = [bench_loop.summarise("stream", bench_loop.per_save(_reports(1, 0.1) + _reports(2, 0.1)))]
    meta = {"command": "c", "date": "d", "commit": "x", "steps": 2, "seconds": 1.0, "machine": "m"}
    report = tmp_path / "BENCHMARKS.md"
    bench_loop.write_section(bench_loop.render_section({"rows": rows, "meta": {**meta, "size": "tiny"}}), report)
    bench_loop.write_section(bench_loop.render_section({"rows": rows, "meta": {**meta, "size": "0.25b"}}), report)
    bench_loop.write_section(bench_loop.render_section({"rows": rows, "meta": {**meta, "size": "0.25b"}}), report)
    text = report.read_text()
    assert text.count(bench_loop.markers("tiny")[0]) == 1 and text.count(bench_loop.markers("0.25b")[0]) == 1
    assert "training loop (0.25b)" in text and "random 0.25b Llama" in text
