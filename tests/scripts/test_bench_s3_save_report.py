"""scripts/bench/s3_save_report.py from the committed results: each target's summary and the section follow
the rows of docs/bench_s3_save*.json (the renders before and after the running/rendering split agreed)."""

import json

import pytest

from scripts.bench import s3_save_report as report
from tests.helpers.launch import REPO


@pytest.mark.parametrize("name", ["bench_s3_save.json", "bench_s3_save_59063b1.json"])
def test_the_section_renders_every_target_of_the_committed_json(name):
    result = json.loads((REPO / "docs" / name).read_text())
    summary = report.summarise(result)
    text = report.render_section(result)
    assert text.startswith(report.BEGIN + "\n") and text.rstrip("\n").endswith(report.END)
    assert set(summary["targets"]) == {r["target"] for r in result["rows"]}
    for target, entry in summary["targets"].items():
        assert entry["runs"] == sum(
            r["target"] == target and r["preset"] == result["meta"]["preset"] for r in result["rows"]
        )
        assert report.wall_words(entry) in text
    for name_, ok, value in report.targets(result):
        assert f"| {name_} | {'✓' if ok else '✗'} | {value} |" in text
