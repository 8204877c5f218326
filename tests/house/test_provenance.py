"""scripts/provenance.py: the commit the benchmark scripts write next to their numbers."""

from __future__ import annotations

import subprocess

from scripts import provenance
from tests.helpers.launch import REPO


def test_head_and_only_code_changes_count():
    head = subprocess.run(
        ["git", "rev-parse", "--short=9", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    code_dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", *provenance.CODE_PATHS],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert provenance.source_commit(short=9) == head + (" (with uncommitted changes)" if code_dirty else "")


def test_outside_a_checkout_it_says_unknown(monkeypatch, tmp_path):
    monkeypatch.setattr(provenance, "REPO", str(tmp_path))
    assert provenance.source_commit() == "unknown"
