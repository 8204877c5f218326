"""scripts/faults/corruption_report.py from the committed results: RELIABILITY.md's corruption lines and its
damaged-restart section are what the report renders from docs/reliability/*.json, byte for byte."""

import json

from scripts.faults import corruption_report as report
from tests.helpers.launch import REPO

RESULTS = REPO / "docs" / "reliability"


def test_the_committed_corruption_lines_are_the_render_of_their_json():
    text = report.render(json.loads((RESULTS / "corruption.json").read_text()))
    assert text.startswith("slimckpt formats: ") and text in (REPO / "RELIABILITY.md").read_text()


def test_the_committed_damaged_restart_section_is_the_render_of_its_json():
    text = report.render_damaged(json.loads((RESULTS / "damaged_restarts.json").read_text()))
    assert text.startswith("## The newest step damaged") and text in (REPO / "RELIABILITY.md").read_text()
    assert "$WORK" in text  # the run's scratch path is not published
