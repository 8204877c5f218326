"""scripts/bench/scale.py's pieces that a run depends on and that `make test` can afford: the memory
cap that stops verl's merger, the free-disk refusal, the report kept by `make bench`, and a merge
killed midway. What the report renders from a run's JSON is in tests/scripts/test_bench_scale_report.py."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time

from ..conftest import REPO


def _load(name: str):
    return importlib.import_module(f"scripts.bench.{name}")


# a process that grows its anonymous memory by 32 MiB every 20 ms, to 1 GiB, and then sleeps
GROW = (
    "import time\nheld = []\nfor i in range(32):\n    held.append(bytearray(32 << 20))\n    "
    # 20 ms a step: the 20 ms sampler sees each; 30 s: alive until the cap kills it
    "print(f'step {i}', flush=True)\n    time.sleep(0.02)\ntime.sleep(30)\n"
)


def test_capped_run_is_killed_past_its_cap():
    scale = _load("scale")
    cap = 256 << 20
    start = time.perf_counter()
    got = scale.run_capped([sys.executable, "-c", GROW], {}, cap)
    assert got["killed"] and got["returncode"] == -9, got
    assert cap < got["peak_rss_anon"] < cap + (160 << 20), got["peak_rss_anon"]
    assert time.perf_counter() - start < 20
    assert "step 3" in got["output_tail"] and "step 31" not in got["output_tail"]


def test_capped_run_below_its_cap_finishes():
    scale = _load("scale")
    got = scale.run_capped(  # alive 0.5 s after it allocates, so the 20 ms sampler sees its 64 MiB
        [sys.executable, "-c", "import time; x = b'1' * (64 << 20); time.sleep(0.5); print('done')"], {}, 1 << 30
    )
    assert not got["killed"] and got["returncode"] == 0 and "done" in got["output_tail"]
    assert got["peak_rss_anon"] >= 64 << 20


def test_too_little_disk_is_said_and_nothing_is_measured(tmp_path):
    out = tmp_path / "B.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.bench.scale",
            "--min-free-gib",
            "1e9",
            "--work",
            str(tmp_path / "w"),
            "--json",
            str(tmp_path / "s.json"),
            "--out",
            str(out),
            "--readme",
            "",
        ],
        capture_output=True,
        text=True,
        # the free-disk check refuses at start-up, before any measuring; 120 s is a hang
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "GiB free" in proc.stdout and "nothing measured" in proc.stdout
    assert not out.exists() and not (tmp_path / "s.json").exists()


def test_merge_bench_keeps_the_scale_section(tmp_path):
    bench = _load("merge")
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("old\n\n<!-- scale-bench:begin -->\nS\n<!-- scale-bench:end -->\n")
    bench.write_keeping_save_section(out, "new\n")
    assert out.read_text() == "new\n\n<!-- scale-bench:begin -->\nS\n<!-- scale-bench:end -->\n"


def test_a_merge_killed_midway_leaves_nothing_complete_and_the_same_command_recovers(tmp_path):
    scale, report = _load("scale"), _load("scale_report")
    ckpt = tmp_path / "ckpt" / "actor"
    scale.build("tiny", 2, ckpt)
    # killed while it imports: the earliest a user's kill can land; the SIGKILL campaign kills merges
    # at random moments of their writes (RELIABILITY.md), the scale bench halfway through an 8B one
    found = scale.killed_midway(ckpt, tmp_path, 0.5)
    assert found["killed"] and found["returncode"] == -9, found
    assert report.left_looks_incomplete(found), found
    assert found["verify_after_kill"]["said"], found
    assert report.rerun_recovers(found), found
    assert not (tmp_path / "merged").exists()  # cleaned up after itself
