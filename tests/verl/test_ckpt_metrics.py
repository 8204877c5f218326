"""verl/ckpt_metrics: the ckpt/* summary of the per-rank save reports, logged at the save step through the
trainer's logger."""

import pytest

from slimckpt.observe.save_reports import read_reports, write_report
from slimckpt.verl.ckpt_metrics import summarize


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
