"""The records of an incremental step, each written so that a reader sees the old one or the whole
new one (format.resume_manifest holds what they say and how they are read):

  - the manifest, `slimckpt_resume.json`: LAST, it commits the step (`commit_manifest` never
    writes over a committed one; `write_manifest` replaces, for a record rewritten on purpose),
    and removed FIRST when the step is written again or deleted (`remove_manifest`);
  - a failed rank's note (`write_failure`), never next to a manifest;
  - verl's tracker, `latest_checkpointed_iteration.txt` (`write_tracker`), which only moves forward.
"""

from __future__ import annotations

import os

from slimckpt.engine.manifest_put import put_manifest
from slimckpt.layout.resume_manifest import (
    FAILED_PREFIX,
    MANIFEST_NAME,
    TRACKER_NAME,
    Manifest,
    has_manifest,
    read_tracker,
)
from slimckpt.storage import for_path


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` so that a reader sees either the old file or the whole new one."""
    for_path(path).put_atomic(path, text.encode())


def write_manifest(role_dir: str, manifest: Manifest, name: str = MANIFEST_NAME) -> str:
    """A manifest rewritten on purpose (over the one there, if any), as `name` in `role_dir`."""
    return put_manifest(os.path.join(role_dir, name), manifest.to_bytes(), replace=True)


def commit_manifest(role_dir: str, manifest: Manifest) -> str:
    """The manifest that commits a step: FileExistsError when the dir already holds one (its
    writer removed it before the step was written again: one there now is another's commit)."""
    return put_manifest(os.path.join(role_dir, MANIFEST_NAME), manifest.to_bytes())


def remove_manifest(role_dir: str) -> None:
    """Un-commit a directory before it is written again (a re-save of the same step)."""
    path = os.path.join(role_dir, MANIFEST_NAME)
    store = for_path(path)
    if store.exists(path):
        store.remove(path)
        store.sync(role_dir)


def write_failure(role_dir: str, rank: int, message: str) -> bool:
    """A save that failed leaves a note, so whoever waits for the commit stops waiting. Never next
    to a manifest: once it is written the step is committed (every file listed, checksummed, on
    disk, and the tracker's watcher may already name it), and what fails after it (a peer lost
    while every rank learns the outcome) is raised but does not uncommit the step. False if the
    dir holds a manifest and no note was written."""
    if has_manifest(role_dir):
        return False
    for_path(role_dir).make_dirs(role_dir, exist_ok=True)
    atomic_write_text(os.path.join(role_dir, f"{FAILED_PREFIX}{rank}.txt"), message + "\n")
    return True


def write_tracker(root: str, step: int) -> bool:
    """Point verl's tracker at `step` unless it already names a later one. True if written."""
    current = read_tracker(root)
    if current is not None and current >= step:
        return False
    atomic_write_text(os.path.join(root, TRACKER_NAME), str(int(step)))
    return True


__all__ = [
    "atomic_write_text",
    "commit_manifest",
    "remove_manifest",
    "write_failure",
    "write_manifest",
    "write_tracker",
]
