"""scripts/faults/reliability_report.py from the committed results: RELIABILITY.md up to its S3 section (pasted in
from scripts/faults/s3.py --render) is what reliability_md() assembles from docs/reliability/, byte for byte, when
no row is flagged as run on older code."""

from scripts.faults import reliability_report as report
from scripts.faults.report import STALE, Flag
from tests.helpers.launch import REPO


def test_the_committed_report_is_the_render_of_its_json():
    text = report.reliability_md(check=lambda provenance, paths: None)
    assert text.startswith("# Reliability\n") and "## One rank lost mid-save or mid-merge" in text
    assert (REPO / "RELIABILITY.md").read_text().startswith(text)


def test_a_flagged_row_is_marked_and_said_under_its_table():
    flag = Flag(STALE, "run on abc; changed `x`")
    text = report.reliability_md(check=lambda provenance, paths: flag)
    assert "**[stale]**" in text and "run on abc; changed `x`." in text
