"""**The** one put of a manifest, through the storage of its path: the record that commits a dir
(a merge output's manifest.json, an incremental step's slimckpt_resume.json), durable with its
directory entry once this returns, and never written over a committed one.

No torch.
"""

from __future__ import annotations

import errno
import os

from slimckpt.storage import for_path


def put_manifest(path: str, data: bytes, *, replace: bool = False) -> str:
    """`data` (`format.merge_manifest.manifest_bytes`) as the whole of `path`: FileExistsError when
    one is there already (another writer's commit), unless `replace` (a record rewritten on purpose,
    which a reader sees whole, old or new). Returns `path`."""
    store = for_path(path)
    if replace:
        store.put_atomic(path, data)
    elif not store.put_if_absent(path, data):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
    return path


__all__ = ["put_manifest"]
