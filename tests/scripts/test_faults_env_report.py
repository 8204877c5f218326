"""scripts/faults/env_report.py from the committed results: RELIABILITY.md's environment table is what the report
renders from docs/reliability/env_faults.json, byte for byte; a verdict names what went wrong."""

import json

from scripts.faults import env_report as report
from tests.helpers.launch import REPO


def test_the_committed_env_table_is_the_render_of_its_json():
    rows = json.loads((REPO / "docs" / "reliability" / "env_faults.json").read_text())["rows"]
    text = report.render(rows)
    assert len(text.splitlines()) == len(rows) + 2 and text in (REPO / "RELIABILITY.md").read_text()


def test_a_verdict_says_what_went_wrong():
    row = {"path": "quickstart", "fault": "disk_full", "failed": True, "looks_committed": True, "names_path": True}
    assert report.verdict(row) == "partial looks committed"
    assert report.verdict({**row, "looks_committed": False, "message": "use --target_dir"}) == (
        "a merge's fix for a trainer"
    )
    assert report.verdict({"failed": False, "looks_committed": None}) == "NO ERROR"
