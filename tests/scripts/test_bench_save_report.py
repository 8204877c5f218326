"""scripts/bench/save_report.py from the committed results: BENCHMARKS.md's save sections (FSDP2 and FSDP1) are
what the report renders from their JSON, byte for byte; a --tag run's section has markers of its own."""

import json

import pytest

from scripts.bench import save_report as report
from tests.helpers.launch import REPO


def _load(name):
    return json.loads((REPO / "docs" / name).read_text())


@pytest.mark.parametrize("name", ["bench_save.json", "bench_save_fsdp1.json"])
def test_the_committed_save_section_is_the_render_of_its_json(name):
    text = report.render_section(_load(name))
    assert text in (REPO / "BENCHMARKS.md").read_text()


def test_a_tagged_run_renders_between_its_own_markers():
    result = _load("bench_save_stream_0.25b.json")
    begin, end = report.markers(result["meta"]["tag"])
    text = report.render_section(result)
    assert text.startswith(begin + "\n") and text.rstrip("\n").endswith(end)
    assert (begin, end) != (report.BEGIN, report.END) and report.PICTURE not in text
    assert all(report.label(r) in text for r in result["rows"])
