"""slimckpt.engine.writer_stats: where the writer's time went, and the JSON file."""

from slimckpt.engine.writer_stats import STATS_ENV, WriterStats, requested_path


def test_round_trip_leaves_no_temporary(tmp_path):
    stats = WriterStats(wall_s=1.5, cast_s=0.4, close_s=0.1)
    stats.save(str(tmp_path / "s.json"))
    assert WriterStats.load(str(tmp_path / "s.json")) == stats
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


def test_an_older_runs_read_thread_timings_are_left_out():
    old = {"wall_s": 4.0, "read_bytes": 123, "read_s": 3.8, "read_threads": 1, "cast_s": 1.4, "close_s": 0.05}
    assert WriterStats.from_dict(old) == WriterStats(wall_s=4.0, cast_s=1.4, close_s=0.05)


def test_only_a_non_empty_setting_asks(monkeypatch):
    monkeypatch.setenv(STATS_ENV, "")
    assert requested_path() is None
    monkeypatch.setenv(STATS_ENV, "/x/y.json")
    assert requested_path() == "/x/y.json"
