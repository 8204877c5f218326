"""scripts/faults/s3_report.py from the committed results: RELIABILITY.md's S3 table is what the report renders
from docs/reliability/s3.json, byte for byte; every trial is counted in its cell once."""

import json

from scripts.faults import s3_report as report
from tests.helpers.launch import REPO


def _data():
    return json.loads((REPO / "docs" / "reliability" / "s3.json").read_text())


def test_the_committed_s3_section_is_the_render_of_its_json():
    assert report.render(_data()) in (REPO / "RELIABILITY.md").read_text()


def test_each_trial_counts_once_in_its_cell():
    data = _data()
    rows = report.summary(data["trials"])
    assert sum(r["trials"] for r in rows) == len(data["trials"])
    for r in rows:
        assert r["cell"] in report.CELLS and sum(r[o] for o in report.GOOD + report.BAD) == r["trials"]
