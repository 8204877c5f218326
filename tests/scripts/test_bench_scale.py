"""scripts/bench/scale.py's command line without a run: the two merges' commands, and --render rewriting only its
marked sections of the report and README from an earlier run's JSON (the JSON itself only when there is something
to add to it). Its capped runs, its free-disk refusal and a merge killed midway run in tests/e2e/test_bench_scale.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from scripts.bench import scale
from scripts.bench.scale_report import DISTRIBUTED, SINGLE
from tests.helpers.launch import REPO


def test_the_distributed_merge_is_the_single_one_under_torchrun():
    single = scale.merge_command(SINGLE, Path("/c"), Path("/t"), workers=3)
    dist = scale.merge_command(DISTRIBUTED, Path("/c"), Path("/t"), workers=3)
    assert single[0] == sys.executable and "--distributed_merge" not in single
    assert dist[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3"]
    assert dist[5:] == [*single[1:], "--distributed_merge"]


def _render(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    for name in ("BENCHMARKS.md", "README.md"):
        shutil.copy(REPO / name, tmp_path / name)
    shutil.copy(REPO / "docs" / "bench_scale.json", tmp_path / "s.json")
    return subprocess.run(
        [sys.executable, "-m", "scripts.bench.scale", "--render", str(tmp_path / "s.json")]
        + ["--out", str(tmp_path / "BENCHMARKS.md"), "--readme", str(tmp_path / "README.md"), *extra],
        capture_output=True,
        text=True,
        timeout=120,  # renders in under a second; 120 s is a hang
        cwd=REPO,
    )


def test_render_of_the_committed_json_leaves_every_file_as_committed(tmp_path):
    proc = _render(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "BENCHMARKS.md").read_text() == (REPO / "BENCHMARKS.md").read_text()
    assert (tmp_path / "README.md").read_text() == (REPO / "README.md").read_text()
    assert (tmp_path / "s.json").read_bytes() == (REPO / "docs" / "bench_scale.json").read_bytes()
    assert proc.stdout.startswith("<!-- scale-bench:begin -->")


def test_a_note_given_with_render_is_kept_in_the_json_and_shown_under_the_targets(tmp_path):
    proc = _render(tmp_path, "--note", "Run on a shared host.")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"note": "Run on a shared host."' in (tmp_path / "s.json").read_text()
    assert "\nRun on a shared host.\n<!-- scale-bench:end -->" in (tmp_path / "BENCHMARKS.md").read_text()
