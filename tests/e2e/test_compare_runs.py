"""scripts/compare/runs.py and its wandb reader (observe/wandb_history) on real wandb offline runs (written by
the wandb library in a subprocess, a few seconds each)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slimckpt.observe.wandb_history import iter_records, load

from ..conftest import REPO, run_python

COMPARE = ("-m", "scripts.compare.runs")


def _wandb_run(wandb_dir: Path, rows: dict[int, dict[str, float]]) -> None:
    """An offline wandb run logging `rows` ({step: metrics}), written by the wandb library."""
    code = textwrap.dedent(
        f"""
        import wandb
        run = wandb.init(mode="offline", dir={str(wandb_dir)!r}, project="t", settings=wandb.Settings(silent=True))
        for step, metrics in sorted({rows!r}.items()):
            wandb.log(metrics, step=step)
        run.finish()
        """
    )
    # wandb's offline start-up and a few logged rows: seconds; 120 s is a hang
    proc = run_python(code, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _rows(steps, reward=lambda s: 0.1 * s, val_every=2, save_every=2):
    rows = {}
    for s in steps:
        row = {"critic/score/mean": reward(s)}
        if s % val_every == 0:
            row["val-core/tiny/reward/mean@1"] = reward(s) / 2
        if s % save_every == 0:
            row.update({"ckpt/peak_rss_extra_gb": 0.001 * s, "ckpt/peak_host_rss_gb": 0.4, "ckpt/seconds": 0.05})
        rows[s] = row
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb_runs")
    _wandb_run(root / "ref", _rows(range(1, 7)))
    _wandb_run(root / "same", _rows(range(1, 7)))
    _wandb_run(root / "other", _rows(range(1, 7), reward=lambda s: 0.1 * s + (0.5 if s >= 4 else 0)))
    # a run that stopped after step 3 and its resume from step 3 to 6, in one WANDB_DIR
    _wandb_run(root / "resumed", _rows(range(1, 4)))
    _wandb_run(root / "resumed", _rows(range(3, 7)))
    return root


@pytest.mark.slow  # five wandb runs written by the wandb library (measured: BENCHMARKS.md)
def test_reader_reads_history_and_joins_a_resumed_run(runs):
    ref = load(f"ref={runs / 'ref'}")
    assert sorted(ref.rows) == [1, 2, 3, 4, 5, 6]
    assert ref.series("critic/score/mean")[-1] == (6, pytest.approx(0.6))
    assert [s for s, _ in ref.series("ckpt/peak_rss_extra_gb")] == [2, 4, 6]
    resumed = load(f"r={runs / 'resumed'}")
    assert len(resumed.sources) == 2  # both runs below the dir, oldest first
    assert resumed.series("critic/score/mean") == ref.series("critic/score/mean")


@pytest.mark.slow  # five wandb runs written by the wandb library (measured: BENCHMARKS.md)
def test_reader_stops_cleanly_at_a_truncated_tail(runs, tmp_path):
    """A SIGKILLed trainer leaves a .wandb file cut anywhere: the complete records still count."""
    src = next((runs / "ref").glob("**/run-*.wandb"))
    data = src.read_bytes()
    run_dir = tmp_path / "offline-run-20260101_000000-cut"
    run_dir.mkdir()
    whole = load(f"whole={src.parent}")
    seen = set()
    for cut in range(len(data) // 3, len(data), 97):
        (run_dir / "run-cut.wandb").write_bytes(data[:cut])
        try:
            part = load(f"cut={run_dir}")
        except Exception as exc:  # only "no history yet" is acceptable for an early cut
            assert "no numeric history" in str(exc)
            continue
        assert set(part.rows) <= set(whole.rows)
        seen.add(len(part.rows))
        for step, row in part.rows.items():
            assert all(whole.rows[step][k] == v for k, v in row.items())
    assert seen and max(seen) <= len(whole.rows)


def test_reader_rejects_what_is_not_a_run(tmp_path):
    bad = tmp_path / "run-x.wandb"
    bad.write_bytes(b"not a wandb file")
    with pytest.raises(Exception, match="not a wandb run file"):
        list(iter_records(bad))


@pytest.mark.slow  # five wandb runs written by the wandb library (measured: BENCHMARKS.md)
def test_compare_runs_writes_png_and_table(runs, tmp_path):
    out, table = tmp_path / "cmp.png", tmp_path / "cmp.md"
    proc = subprocess.run(
        [
            sys.executable,
            *COMPARE,
            f"ref={runs / 'ref'}",
            f"same={runs / 'same'}",
            f"other={runs / 'other'}",
            f"resumed={runs / 'resumed'}",
            "--out",
            str(out),
            "--table",
            str(table),
        ],
        capture_output=True,
        text=True,
        # reads four offline runs and draws one plot: seconds; 120 s is a hang
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    text = table.read_text()
    assert text == proc.stdout
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    assert "identical (6 steps)" in rows["`same`"] and "identical (3 steps)" in rows["`same`"]
    assert "identical (6 steps)" in rows["`resumed`"]
    assert "differs from step 4" in rows["`other`"]
    assert "identical (2 metrics)" in rows["`same`"]  # every training metric; ckpt/* are not compared
    assert "2/2 differ, e.g. `critic/score/mean`" in rows["`other`"]  # reward and validation
    assert "| 6 | 0.6 | 0.3 | 3 | 5.72 |" in rows["`ref`"]  # final reward, final val, 3 saves, 0.006 GB in MiB


def test_compare_runs_bad_path_is_one_line_and_no_png(tmp_path):
    out = tmp_path / "x.png"
    proc = subprocess.run(
        [sys.executable, *COMPARE, str(tmp_path / "missing" / "dir"), "--out", str(out)],
        capture_output=True,
        text=True,
        # the bad path fails at start-up, before any run is read; 60 s is a hang
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().count("\n") == 0 and "compare_runs.py:" in proc.stderr
