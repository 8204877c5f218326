"""scripts/bench/merge_report.py from the committed results: BENCHMARKS.md's merge section and docs/merge.md's
block are what the report renders from docs/bench_merge.json, byte for byte (merge.py --render writes them)."""

import json
from types import SimpleNamespace

from scripts.bench import merge_report as report
from tests.helpers.launch import REPO


def _saved():
    saved = json.loads((REPO / "docs" / "bench_merge.json").read_text())
    return [report.MergeRow(**r) for r in saved["rows"]], saved


def test_the_committed_merge_section_is_the_render_of_its_json():
    rows, saved = _saved()
    args = SimpleNamespace(plot=str(REPO / "docs" / "merge_peak_memory.png"), out=str(REPO / "BENCHMARKS.md"))
    text = report.render_report(rows, saved, args)
    assert text.startswith("# Benchmarks\n") and "![peak memory vs model size](docs/merge_peak_memory.png)" in text
    assert text in (REPO / "BENCHMARKS.md").read_text()


def test_the_committed_merge_doc_block_is_the_render_of_its_json():
    rows, saved = _saved()
    block = report.summary_block(rows, saved)
    assert block.strip() and block in (REPO / "docs" / "merge.md").read_text()
