"""An output directory's life on its storage (format.merge_manifest holds its records):

    1. check_room        refused before anything is written when its filesystem cannot hold it
    2. prepare_partial   `<target>.partial/` made fresh (a stale one, ours by its name, removed)
    3. ...               the writers fill it (out_files)
    4. write_manifest    manifest.json, last, never over one already there
    5. commit            every file durable, then the dir put in place as `<target>` in one step (a
                         target being replaced set aside, and deleted once the new one is in)
       discard_partial   or, on failure, the partial dir removed

No torch.
"""

from __future__ import annotations

import errno
import os

from slimckpt.engine.manifest_put import put_manifest
from slimckpt.layout.merge_manifest import MANIFEST_NAME, CommitError, Manifest, dir_is_empty, partial_path
from slimckpt.storage import for_path
from slimckpt.storage.os_errors import os_failure


def check_room(target: str, need_bytes: int) -> None:
    """Refuse an output its filesystem cannot hold, before `<target>.partial` is made: CommitError
    naming the bytes needed and free. A stale `<target>.partial` counts as free (prepare_partial
    deletes it first: a merge killed midway must not block its own rerun); a target being replaced
    does not (it is deleted only once the new output is committed)."""
    target = os.path.abspath(target)
    store = for_path(target)
    try:
        free = store.free_bytes(os.path.dirname(target))
    except OSError:
        return  # a missing parent: check_target and prepare_partial say so in their words
    free += store.used_bytes(partial_path(target))
    if need_bytes > free:
        raise os_failure(CommitError, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), target, need_bytes, free)


def prepare_partial(target: str) -> str:
    """Create a fresh `<target>.partial/` (a stale one, ours by its name, is removed first)."""
    partial = partial_path(target)
    store = for_path(partial)
    try:
        if os.path.lexists(partial):
            if os.path.isdir(partial) and not os.path.islink(partial):
                store.remove_tree(partial)
            else:
                store.remove(partial)
        store.make_dirs(partial)
    except OSError as exc:
        raise os_failure(CommitError, exc, partial) from None
    return partial


def write_manifest(root: str, manifest: Manifest) -> str:
    """manifest.json into `root`, durable with its entry; FileExistsError when one is there."""
    return put_manifest(os.path.join(root, MANIFEST_NAME), manifest.to_bytes())


def commit(partial: str, target: str, overwrite: bool = False) -> None:
    """Put the finished `partial` dir in place as `target` (replacing an empty dir, or any with overwrite)."""
    target = os.path.abspath(target)
    store = for_path(target)
    store.sync_tree(partial)
    old = None
    try:
        if os.path.isdir(target) and not dir_is_empty(target):
            if not overwrite:
                raise CommitError(
                    f"{target} became non-empty while merging; nothing was replaced, the result is in {partial}"
                )
            old = f"{target}.old-{os.getpid()}"
        store.atomic_publish(partial, target, aside=old, durable=False)
    except OSError as exc:
        raise os_failure(CommitError, exc, target) from None
    store.sync(os.path.dirname(target))
    if old is not None:
        store.remove_tree(old, ignore_errors=True)


def discard_partial(partial: str) -> bool:
    try:
        for_path(partial).remove_tree(partial)
        return True
    except OSError:
        return False


__all__ = ["check_room", "commit", "discard_partial", "prepare_partial", "write_manifest"]
