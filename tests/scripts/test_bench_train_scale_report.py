"""scripts/bench/train_scale_report.py from the committed results: BENCHMARKS.md's train-scale section and
README's rows are what the report renders from docs/bench_train_scale.json, byte for byte."""

import json

from scripts.bench import train_scale_report as report
from tests.helpers.launch import REPO


def _result():
    return json.loads((REPO / "docs" / "bench_train_scale.json").read_text())


def test_the_committed_section_is_the_render_of_its_json():
    text = report.render_section(_result())
    assert text.startswith(report.BEGIN) and text in (REPO / "BENCHMARKS.md").read_text()


def test_readmes_rows_are_the_render_of_its_json(tmp_path):
    readme = (REPO / "README.md").read_text()
    assert report.headline(_result()) in readme
    copy = tmp_path / "README.md"
    copy.write_text(readme)
    report.write_readme(_result(), copy)
    assert copy.read_text() == readme
