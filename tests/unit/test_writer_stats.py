"""slimckpt.write.writer_stats: the share of the writer's time its reads took, and the JSON file."""

from slimckpt.write.writer_stats import STATS_ENV, WriterStats, requested_path


def test_read_busy_is_per_thread_and_safe_on_empty_runs():
    assert WriterStats(wall_s=4.0, read_s=3.8, read_threads=1).read_busy() == 0.95
    assert WriterStats(wall_s=4.0, read_s=6.0, read_threads=2).read_busy() == 0.75
    assert WriterStats().read_busy() == 0.0


def test_round_trip_leaves_no_temporary(tmp_path):
    stats = WriterStats(wall_s=1.5, read_bytes=123, read_s=1.2, read_threads=1, cast_s=0.4)
    stats.save(str(tmp_path / "s.json"))
    assert WriterStats.load(str(tmp_path / "s.json")) == stats
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


def test_only_a_non_empty_setting_asks(monkeypatch):
    monkeypatch.setenv(STATS_ENV, "")
    assert requested_path() is None
    monkeypatch.setenv(STATS_ENV, "/x/y.json")
    assert requested_path() == "/x/y.json"
