"""Which code a measurement ran: HEAD as the run starts, and whether the code it runs differed from it.

Shared by the scripts that write numbers into README/BENCHMARKS (scripts.bench, scripts.faults,
scripts.compare, scripts.quickstart). Only the code paths count as "uncommitted changes": a campaign writing its JSON
into docs/ at the same time does not change what a benchmark ran.
"""

from __future__ import annotations

import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE_PATHS = ("patches", "recipes", "overrides", "scripts")


def _git(*args: str) -> str | None:
    proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def source_commit(short: int = 7) -> str:
    """'abc1234', 'abc1234 (with uncommitted changes)', or 'unknown' outside a git checkout."""
    head = _git("rev-parse", f"--short={short}", "HEAD")
    if not head:
        return "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
    return head + (" (with uncommitted changes)" if dirty else "")
