"""Where a measured save's per-rank reports live, and reading them back.

Reports are measurements, not checkpoint state, so they stay out of the checkpoint's dirs (a
verify of a step, verl's loader and its merger never see them): a save of
`<root>/global_step_N/<role>` reports into `<root>/slimckpt_reports/global_step_N/<role>/`.

Two kinds per rank:
- `rank_<r>.save.json`, when the save call returns: the time training was blocked, the peak
  anonymous RSS over that window, and for a sync save also the bytes and total seconds;
- `rank_<r>.commit.json`, for an async save, when its background write commits: the write's
  seconds, the bytes written, the peak RSS over the write window and the staging pool held.

A sync save's `save` report is committed as it is written (`"committed": true`); an async one's
is not, and its numbers of the write come with the `commit` report. Reports of a step whose role
dir retention removed are pruned when the next report is written.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any

from slimckpt.log import get_logger
from slimckpt.storage import for_path, is_url

log = get_logger("slimckpt.save_reports")

REPORTS_DIR = "slimckpt_reports"
KINDS = ("save", "commit")
_STEP_DIR = re.compile(r"^global_step_\d+$")


def norm_dir(path: str) -> str:
    """normpath of a local path; a URL keeps its "//" (normpath would fold it into a local path)."""
    return str(path).rstrip("/") if is_url(path) else os.path.normpath(path)


def checkpoint_root(step_dir: str) -> str:
    return os.path.dirname(norm_dir(step_dir))


def report_dir(local_path: str) -> str:
    """`<root>/slimckpt_reports/<step dir name>/<role>` for a role dir `<root>/<step dir>/<role>`."""
    role_dir = norm_dir(local_path)
    step_dir = os.path.dirname(role_dir)
    return os.path.join(checkpoint_root(step_dir), REPORTS_DIR, os.path.basename(step_dir), os.path.basename(role_dir))


def report_path(local_path: str, rank: int, kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"report kind must be one of {KINDS}, got {kind!r}")
    return os.path.join(report_dir(local_path), f"rank_{int(rank)}.{kind}.json")


def write_report(report: dict[str, Any], local_path: str, rank: int, kind: str) -> str:
    """Write one report (temp file + rename: a reader never sees half of one); returns its path."""
    path = report_path(local_path, rank, kind)
    store = for_path(path)
    store.make_dirs(os.path.dirname(path), exist_ok=True)
    text = json.dumps({**report, "kind": kind}, indent=1)
    store.put_atomic(path, text.encode(), tmp=f"{path}.tmp", sync=False, sync_dir=False)
    return path


def prune(root: str) -> list[str]:
    """Remove the reports of role dirs that no longer exist (retention deleted them); returns what
    was removed. Best effort: another rank may be pruning too."""
    removed = []
    base = os.path.join(root, REPORTS_DIR)
    for step_reports in sorted(glob.glob(os.path.join(base, "global_step_*"))):
        step = os.path.basename(step_reports)
        if not _STEP_DIR.match(step):
            continue
        for role_reports in sorted(glob.glob(os.path.join(step_reports, "*"))):
            if not os.path.isdir(os.path.join(root, step, os.path.basename(role_reports))):
                for_path(role_reports).remove_tree(role_reports, ignore_errors=True)
                removed.append(role_reports)
        try:
            os.rmdir(step_reports)  # only when empty
        except OSError:
            pass
    return removed


def _read(paths: list[str]) -> list[dict[str, Any]]:
    reports = []
    for path in paths:
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, ValueError) as exc:
            log.warning("skipping unreadable save report %s: %s", path, exc)
            continue
        report.setdefault("role", os.path.basename(os.path.dirname(path)))
        reports.append(report)
    return reports


def read_reports(step_dir: str, global_step: int, not_before: float = 0.0, kind: str = "save") -> list[dict[str, Any]]:
    """One step's reports of `kind`, every role and rank; reports of another step or older than
    `not_before` (a previous run's save of the same step) are skipped."""
    pattern = os.path.join(
        checkpoint_root(step_dir), REPORTS_DIR, os.path.basename(norm_dir(step_dir)), "*", f"rank_*.{kind}.json"
    )
    return [
        r
        for r in _read(sorted(glob.glob(pattern)))
        if int(r.get("global_step", -1)) == int(global_step) and float(r.get("time", 0.0)) >= not_before
    ]


def read_commits(root: str, not_before: float = 0.0) -> dict[int, list[dict[str, Any]]]:
    """Every async commit report under `root`, by step (newer than `not_before`)."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for report in _read(sorted(glob.glob(os.path.join(root, REPORTS_DIR, "global_step_*", "*", "rank_*.commit.json")))):
        if float(report.get("time", 0.0)) >= not_before:
            by_step.setdefault(int(report["global_step"]), []).append(report)
    return by_step
