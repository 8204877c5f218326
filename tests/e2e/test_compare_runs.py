"""scripts/compare/runs.py and its wandb reader on real wandb offline runs (written by the wandb
library in a subprocess, a few seconds each), and the ckpt/* summary of per-rank save reports."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slimckpt.observe.save_reports import read_reports, write_report
from slimckpt.observe.wandb_history import iter_records, load
from slimckpt.verl.ckpt_metrics import summarize

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


def test_ckpt_summary_of_rank_reports(tmp_path):
    step_dir = tmp_path / "global_step_5"
    for role, ranks in (("actor", 2), ("critic", 2)):
        for r in range(ranks):
            report = {
                "global_step": 5,
                "rank": r,
                "role": role,
                "seconds": 1.0 + r,
                "blocking_seconds": 0.5 + r,
                "peak_rss_anon_bytes": (2 + r) * 10**9,
                "peak_rss_extra_bytes": (1 + r) * 10**8,
                "bytes_written": 10**9,
                "time": 100.0,
            }
            write_report(report, str(step_dir / role), r, "save")
    stale = read_reports(str(step_dir), 5)[0]
    write_report({**stale, "global_step": 4}, str(step_dir / "actor"), 0, "save")
    reports = read_reports(str(step_dir), 5)
    assert len(reports) == 3  # the report of another step is ignored
    m = summarize(reports)
    assert m["ckpt/peak_host_rss_gb"] == pytest.approx(3.0)
    assert m["ckpt/peak_rss_extra_gb"] == pytest.approx(0.2)
    assert m["ckpt/bytes_gb"] == pytest.approx(3.0)
    assert m["ckpt/seconds"] == pytest.approx(4.0)  # slowest actor rank + slowest critic rank
    assert m["ckpt/blocking_seconds"] == pytest.approx(3.0)
    assert m["ckpt/throughput_gbps"] == pytest.approx(0.75)
    assert m["ckpt/committed_step"] == 5 and m["ckpt/write_seconds"] == 0.0
    assert m["ckpt/ranks"] == 3 and m["ckpt/critic/seconds"] == pytest.approx(2.0)
    assert read_reports(str(step_dir), 5, not_before=200.0) == []  # an older run's reports
    assert summarize([]) == {}


def test_ckpt_callback_logs_at_the_save_step_through_the_trainers_logger(tmp_path):
    from types import SimpleNamespace

    from slimckpt.verl.ckpt_metrics import CheckpointMetricsCallback

    logged = []
    trainer = SimpleNamespace(logger=SimpleNamespace(log=lambda data, step: logged.append((step, data))))
    callback = CheckpointMetricsCallback(config=None)
    step_dir = tmp_path / "global_step_7"
    callback.on_save(trainer=trainer, global_step=7, checkpoint_dir=str(step_dir))  # no reports: nothing logged
    assert logged == []
    (step_dir / "actor").mkdir(parents=True)
    report = {
        "global_step": 7,
        "rank": 0,
        "role": "actor",
        "seconds": 2.0,
        "blocking_seconds": 2.0,
        "peak_rss_anon_bytes": 10**9,
        "peak_rss_extra_bytes": 10**8,
        "bytes_written": 4 * 10**9,
        "time": __import__("time").time(),
    }
    write_report(report, str(step_dir / "actor"), 0, "save")
    callback.on_save(trainer=trainer, global_step=7, checkpoint_dir=str(step_dir), async_save=False)
    assert [s for s, _ in logged] == [7]
    assert logged[0][1]["ckpt/throughput_gbps"] == pytest.approx(2.0)
    assert logged[0][1]["ckpt/blocking_seconds"] == pytest.approx(2.0)  # a sync save: all of it
