"""verl's trainer with `trainer.default_local_dir` on object storage (`s3://bucket/prefix`).

verl's driver code assumes a local directory: `_load_checkpoint` joins any path that is not absolute
onto the working dir (`<cwd>/s3://...`), `_save_checkpoint` makes the step folder with
`local_mkdir_safe` and writes `data.pt` with `torch.save`, `_load_checkpoint` checks it with
`os.path.exists` and reads it with `torch.load`, and `find_latest_ckpt_path` reads the tracker from
the local filesystem. The workers' own saves and loads already go through the storage of the path
(the incremental tier), so what is left is the driver's side, and it keeps verl's own sequence:
the names those two methods call are replaced in the trainer modules (`patch_list`) by ones that
hand a local path to the original and a URL to the storage:

- `os` (as those modules see it): `os.path.isabs` of a URL is true (no `<cwd>/` in front of it),
  `os.path.exists` of a URL asks the storage;
- `torch`: `torch.save(obj, url)` is one atomic put (a reader sees the whole `data.pt` or none),
  `torch.load(url)` reads it into memory and unpickles it with pickle_policy's globals only (a
  bucket is as untrusted as a disk);
- `local_mkdir_safe` (verl.utils.fs, imported inside `_save_checkpoint`): a URL's folder is made
  by the storage (on an object store there is nothing to make);
- the tracker's `open(path, "w")` is already slimckpt's atomic write (`tracker_write`), through the
  storage of its path.

Which step `resume_mode=auto` loads on a URL (`latest_committed_step`) is derived from what is on
the storage, never from the tracker alone: the newest `global_step_N` whose `data.pt` is there
(verl writes it after every role of the step has saved) and whose every role dir is committed by
its manifest (no failure marker). A tracker that names another step is said in one line and not
followed: the tracker is written after the commit, so a kill between the two leaves it behind,
and one naming a step that never committed is no reason to load it.
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Callable
from typing import Any

from slimckpt.engine import pt_tensors
from slimckpt.layout.resume_manifest import failure_markers, has_manifest, read_tracker, saved_steps
from slimckpt.log import get_logger
from slimckpt.storage import for_path, is_file, is_url

log = get_logger("slimckpt.resume")

DATA_FILE = "data.pt"  # verl's dataloader state in each step folder


# --------------------------------------------------------------------------- which step a resume loads


def uncommitted_reason(step_dir: str) -> str | None:
    """Why the step folder `step_dir` is not one to resume from, or None when it is: its data.pt is
    there and every role dir under it holds its manifest and no failure marker."""
    store = for_path(step_dir)
    if not is_file(os.path.join(step_dir, DATA_FILE)):
        return f"no {DATA_FILE} (its save did not finish)"
    roles = [n.rstrip("/") for n in store.list_dir(step_dir) if store.is_dir(os.path.join(step_dir, n.rstrip("/")))]
    if not roles:
        return "no role dir"
    for role in roles:
        role_dir = os.path.join(step_dir, role)
        if failure_markers(role_dir):
            return f"{role}/ says its save failed"
        if not has_manifest(role_dir):
            return f"{role}/ is not committed (no manifest)"
    return None


def latest_committed_step(root: str) -> int | None:
    """The step resume_mode=auto loads from `root`: the newest committed one (uncommitted_reason),
    whatever the tracker says; None when there is none (a start from scratch)."""
    skipped: list[str] = []
    found = None
    for step in reversed(saved_steps(root)):
        why = uncommitted_reason(os.path.join(root, f"global_step_{step}"))
        if why is None:
            found = step
            break
        skipped.append(f"global_step_{step} ({why})")
    if skipped:
        log.warning("resume: skipped %s in %s: not committed", ", ".join(skipped), root)
    named = read_tracker(root)
    if named is not None and named != found:
        log.warning(
            "resume: %s/latest_checkpointed_iteration.txt names global_step_%s; resuming from %s, the newest "
            "committed step (the storage's manifests decide, not the tracker)",
            root.rstrip("/"),
            named,
            f"global_step_{found}" if found is not None else "scratch (none is committed)",
        )
    return found


# --------------------------------------------------------------------------- the names verl's trainer calls


class _Forward:
    """A module as verl's trainer module sees it, with some of its functions replaced."""

    def __init__(self, original: Any) -> None:
        self.__wrapped__ = original

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)


class _Path(_Forward):
    def isabs(self, path: Any) -> bool:
        return (isinstance(path, str) and is_url(path)) or self.__wrapped__.isabs(path)

    def exists(self, path: Any) -> bool:
        if isinstance(path, str) and is_url(path):
            return for_path(path).exists(path)
        return self.__wrapped__.exists(path)


class _Os(_Forward):
    def __init__(self, original: Any) -> None:
        super().__init__(original)
        self.path = _Path(original.path)


class _Torch(_Forward):
    def save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not (isinstance(f, str) and is_url(f)):
            return self.__wrapped__.save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        self.__wrapped__.save(obj, buffer, *args, **kwargs)
        for_path(f).put_atomic(f, buffer.getvalue())
        return None

    def load(self, f: Any, *args: Any, **kwargs: Any) -> Any:
        if not (isinstance(f, str) and is_url(f)):
            return self.__wrapped__.load(f, *args, **kwargs)
        with for_path(f).open_read(f) as stream:
            data = stream.read()
        return pt_tensors.load_bytes(data, f)  # pickle_policy's globals only, whatever weights_only says


def wrap_os(original: Any) -> Any:
    """The trainer module's `os`: a URL counts as absolute, and exists asks its storage."""
    return _Os(original)


def wrap_torch(original: Any) -> Any:
    """The trainer module's `torch`: save and load of a URL (data.pt) through its storage."""
    return _Torch(original)


def wrap_local_mkdir_safe(original: Callable[[str], str]) -> Callable[[str], str]:
    """verl.utils.fs.local_mkdir_safe: a URL's folder is made by its storage (nothing on an object store)."""

    @functools.wraps(original)
    def local_mkdir_safe(path: str) -> str:
        if isinstance(path, str) and is_url(path):
            for_path(path).make_dirs(path, exist_ok=True)
            return path
        return original(path)

    return local_mkdir_safe


__all__ = [
    "DATA_FILE",
    "latest_committed_step",
    "uncommitted_reason",
    "wrap_local_mkdir_safe",
    "wrap_os",
    "wrap_torch",
]
