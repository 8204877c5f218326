"""scripts/bench.py's report logic (no runs): targets are judged from the rows as measured, and the
words under the targets table state what the rows and disk measurements say."""

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_merge", REPO / "scripts" / "bench.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_merge"] = bench  # its dataclasses look their module up there
_spec.loader.exec_module(bench)

GB, MiB = 10**9, 2**20


def _disk(read, write, mixed):
    return bench.DiskSpeed(write * GB, read * GB, 2**30, mixed_bytes_per_s=mixed * GB)


def _rows(walls_1b):
    rows = []
    for size, params, read, peak_verl, verl_wall in (("0.25b", 0.25e9, 1 * GB, 1700, 8.0),
                                                     ("1b", 1.03e9, 4 * GB, 6200, 21.0)):
        walls = walls_1b if size == "1b" else [2.7, 2.8, 2.9]
        for tool, peak, w in (("verl 0.9.1", peak_verl, [verl_wall]), ("slimckpt", 270, walls)):
            rows.append(bench.MergeRow(size, int(params), tool, peak * MiB, bench.median(w), w, read, read // 2))
    return rows


def _report(walls_1b, disks):
    rows = _rows(walls_1b)
    best = bench.fastest_of(disks)
    for r in rows:
        r.io_floor_s = best.io_floor_s(r.read_bytes, r.written_bytes)
    return bench.targets(rows, best, imports_s=2.9, disks=disks)


def test_floor_target_follows_the_median_wall():
    disks = [_disk(2.0, 2.0, 1.8), _disk(1.8, 2.2, 1.6)]  # best: read 2.0, write 2.2 -> 1b floor 2.91 s
    met = _report([4.0, 4.2, 6.5], disks)
    assert "| wall within 1.5x of the I/O floor (1b) | yes | 1.45x |" in met
    missed = _report([4.0, 5.4, 6.5], disks)
    assert "| wall within 1.5x of the I/O floor (1b) | **no** | 1.86x |" in missed


def test_analysis_states_the_spread_the_mixed_rate_and_the_typical_floor():
    disks = [_disk(2.0, 2.0, 1.8), _disk(1.8, 2.2, 1.6)]
    text = _report([4.0, 5.4, 6.5], disks)
    assert "slimckpt's 3 runs at 1b took 4.0-6.5 s (1.38-2.24x the floor)" in text
    # 6 GB moved at 1.6-1.8 GB/s combined
    assert "1.60-1.80 GB/s combined in the run's 2 measurements: 3.3-3.8 s for these bytes" in text
    assert "against the 4.4 s that 1.5x the floor allows" in text
    assert "slimckpt's median moved them at 1.11 GB/s" in text
    # medians of the measurements: read 1.9, write 2.1 -> 4/1.9 + 2/2.1 = 3.06 s
    assert "the floor would be 3.1 s and the median wall 1.77x it" in text
    assert "The smallest model's merge (0.25b, its bytes 0.7 s at the floor) took 2.8 s." in text


def test_one_disk_measurement_and_one_size_leave_out_what_they_cannot_say():
    rows = [r for r in _rows([4.0]) if r.size == "1b"]
    disk = _disk(2.0, 2.0, 0.0)
    for r in rows:
        r.io_floor_s = disk.io_floor_s(r.read_bytes, r.written_bytes)
    text = bench.targets(rows, disk, imports_s=2.9, disks=[disk])
    assert "runs at 1b took 4.0-4.0 s" in text
    assert "combined" not in text and "median of the run's disk measurements" not in text
    assert "smallest model" not in text
    assert "read thread" not in text  # no writer timings recorded (an older run's JSON)


def _writer(wall, read_s, wait, cast, read_bytes=4 * GB):
    return {"wall_s": wall, "read_bytes": read_bytes, "read_s": read_s, "read_threads": 1,
            "wait_buffer_s": wait, "wait_read_s": 1.0, "cast_s": cast, "close_s": 0.05}


def test_the_writers_timings_say_what_bound_it():
    disks = [_disk(2.0, 2.0, 1.8)]
    rows = _rows([4.0, 4.5, 5.0])
    ours = next(r for r in rows if r.size == "1b" and r.tool == "slimckpt")
    ours.writer_stats = [_writer(4.0, 3.84, 0.05, 1.4), _writer(5.0, 4.9, 0.10, 1.9)]
    best = bench.fastest_of(disks)
    for r in rows:
        r.io_floor_s = best.io_floor_s(r.read_bytes, r.written_bytes)
    text = bench.targets(rows, best, imports_s=2.9, disks=disks)
    assert ("in 2 of these runs: it took 4.0-5.0 s, and its read thread was inside `preadv` for 96-98% of that, "
            "waiting 0.10 s at most") in text
    assert "Its reads moved 0.82-1.04 GB/s while the writes went on; the casts took 1.4-1.9 s." in text
    assert "The disk's reads, not the CPU, bound the merge." in text
    ours.writer_stats = [_writer(5.0, 3.0, 1.5, 2.5)]
    text = bench.targets(rows, best, imports_s=2.9, disks=disks)
    assert "for 60% of that" in text and "the cast or the writes held it back" in text


def test_the_early_writes_row_says_what_it_earns():
    disks = [_disk(2.0, 2.0, 1.8)]
    rows = _rows([4.0, 4.2, 6.5])
    rows.append(bench.MergeRow("1b", int(1.03e9), bench.NO_EARLY, 258 * MiB, bench.median([4.8, 5.0, 5.5]),
                               [4.8, 5.0, 5.5], 4 * GB, 2 * GB))
    best = bench.fastest_of(disks)
    for r in rows:
        r.io_floor_s = best.io_floor_s(r.read_bytes, r.written_bytes)
    text = bench.targets(rows, best, imports_s=2.9, disks=disks)
    assert "it takes 5.0 s (runs 4.8-5.5 s) and peaks at 258 MiB: the early write earns 0.8 s at 1b for 12 MiB" in text
    assert "early write" not in _report([4.0, 4.2, 6.5], disks)  # no such row, no such sentence
