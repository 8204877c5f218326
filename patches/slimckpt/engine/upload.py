"""A finished local output dir (a merge's) put on a medium without directory renames (an `s3://`
prefix), committed the way such a medium commits:

    1. an output committed there before is uncommitted first (its manifest removed, with
       `overwrite`), then its objects and a killed upload's unfinished parts removed
    2. every file but the manifest streamed up (Storage.open_stream: an object store's multipart
       upload, one part buffer per part in flight), read from the local file in READ_BLOCK pieces
    3. the manifest last, written only if absent: two writers never both commit

A reader takes the output only with its manifest, so a kill anywhere before 3 leaves nothing any
reader takes (the next upload, or `slimckpt verify --clean`, drops the leftovers).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

from slimckpt.layout.merge_manifest import MANIFEST_NAME, CommitError
from slimckpt.storage import for_path

READ_BLOCK = 8 << 20


def upload_dir(
    local: str,
    url: str,
    *,
    overwrite: bool,
    overwrite_hint: str = "--overwrite",
    on_bytes: Callable[[int], object] | None = None,
) -> list[str]:
    """Put the committed local dir `local` at `url` (see the module doc); the files uploaded."""
    store = for_path(url)
    url = url.rstrip("/")
    manifest = f"{url}/{MANIFEST_NAME}"
    if store.exists(manifest):
        if not overwrite:
            raise CommitError(
                f"{url} holds a committed output; pass {overwrite_hint} to replace it, or choose another --target_dir"
            )
        store.remove(manifest)  # uncommitted before any of its objects go
    if store.exists(url):  # an uncommitted output: what a killed upload left, or the one just uncommitted
        store.remove_tree(url)
    store.abort_uploads(url + "/")
    files = for_path(local).list_files(local)
    if MANIFEST_NAME not in files:
        raise CommitError(f"{local}: has no {MANIFEST_NAME}; only a committed output is uploaded")
    for rel in files:
        if rel == MANIFEST_NAME:
            continue
        store.make_dirs(os.path.dirname(f"{url}/{rel}"), exist_ok=True)  # nothing to make on an object store
        with open(os.path.join(local, rel), "rb") as src, store.open_stream(f"{url}/{rel}") as dst:
            while block := src.read(READ_BLOCK):
                dst.write(block)
                if on_bytes is not None:
                    on_bytes(len(block))
    with open(os.path.join(local, MANIFEST_NAME), "rb") as f:
        data = f.read()
    if not store.put_if_absent(manifest, data):
        raise CommitError(
            f"{manifest}: another writer committed an output here while this one uploaded "
            f"({os.strerror(errno.EEXIST)}); its files are the ones a reader takes: choose another --target_dir"
        )
    return files


__all__ = ["READ_BLOCK", "upload_dir"]
