"""Steps an earlier launch of the same run left: retention prunes them as it prunes this launch's.

verl's retention tracks only the steps its manager saved since the process started
(`previous_saved_paths`), so every restart of a job leaks the steps saved before it: a job that
keeps crashing fills the disk one step per restart. At this launch's first commit of a role, the
role's steps already under the checkpoint root join the tracked list, oldest first, and the usual
rules apply to them (slimckpt.save.retention.prune: never the step the tracker names, never one a
reader holds, nothing before the new step is complete).

Only steps slimckpt committed join (their role dir has its manifest): a step verl saved before
slimckpt was adopted, or a save that never committed, is left as it is and named once in the log.
A step numbered above the new one (an earlier launch that went further, resumed from an older
step on purpose) is kept and named too: it is not this run's to delete.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from slimckpt.layout.resume_manifest import STEP_DIR, has_manifest, step_of
from slimckpt.log import get_logger
from slimckpt.save.target import TargetState
from slimckpt.storage import absolute, for_path

log = get_logger("slimckpt.retention")


def _role_dirs(root: str, role: str) -> list[tuple[int, str]]:
    store = for_path(root)
    try:
        names = store.list_dir(root) if store.is_dir(root) else []
    except OSError:
        return []
    found = []
    for name in names:
        match = STEP_DIR.match(name.rstrip("/"))
        if match:
            role_dir = os.path.join(root, name.rstrip("/"), role)
            if store.is_dir(role_dir):
                found.append((int(match.group(1)), role_dir))
    return sorted(found)


def earlier_steps(new_path: str, tracked: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """(committed steps to track, oldest first; steps kept as not slimckpt's or not committed; steps
    kept as newer than `new_path`) of `new_path`'s role under its root, beside those in `tracked`."""
    where = step_of(new_path)
    if where is None:
        return [], [], []
    root, new_step = where
    role = os.path.basename(absolute(new_path).rstrip("/"))
    known = {absolute(p).rstrip("/") for p in tracked} | {absolute(new_path).rstrip("/")}
    adopt, foreign, newer = [], [], []
    for step, role_dir in _role_dirs(root, role):
        if absolute(role_dir).rstrip("/") in known:
            continue
        if not has_manifest(role_dir):
            foreign.append(role_dir)
        elif step > new_step:
            newer.append(role_dir)
        else:
            adopt.append(role_dir)
    return adopt, foreign, newer


def track_earlier(state: TargetState, saved_paths: list[str], new_path: str) -> None:
    """Once per target, at its first commit: put the earlier launch's committed steps of this role
    in front of `saved_paths` (in place), and name the ones retention leaves alone."""
    if not state.note_once("earlier launch steps"):
        return
    adopt, foreign, newer = earlier_steps(new_path, saved_paths)
    if adopt:
        log.info(
            "retention also tracks %d step(s) an earlier launch of this run committed: %s",
            len(adopt),
            ", ".join(adopt),
        )
    for role_dir in foreign:
        log.warning(
            "retention keeps %s: it holds no slimckpt manifest (saved by verl before slimckpt, or a save that "
            "never committed); delete it by hand when it is no longer needed",
            role_dir,
        )
    for role_dir in newer:
        log.warning(
            "retention keeps %s: an earlier launch saved it after the step this run resumed from; "
            "delete it by hand when it is no longer needed",
            role_dir,
        )
    saved_paths[:0] = adopt


__all__ = ["earlier_steps", "track_earlier"]
