"""`slimckpt merge` with an `s3://` (any remote medium's) --local_dir or --target_dir.

    1. every URL checked before anything is written (endpoint, credentials, bucket: one line)
    2. a remote step mirrored into a local scratch dir (read.remote_step: its checksums checked as
       it streams past once, only the model's records kept on disk)
    3. the streaming merge on the local mirror, into a local output when the target is remote
    4. a remote target: the committed output uploaded, its manifest last (write.upload)
    5. the scratch dir removed, whatever happened

Host memory stays the local merge's (plus one read block per file fetched, one part buffer per
part in flight); local disk holds the model's records and, for a remote target, the output.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

from tqdm import tqdm

from slimckpt.engine.remote_step import fetch_step, records_of
from slimckpt.engine.upload import upload_dir
from slimckpt.layout.merge_manifest import CommitError
from slimckpt.layout.names import MODEL_PREFIX
from slimckpt.layout.resume_manifest import UncommittedCheckpoint, read_manifest
from slimckpt.log import get_logger
from slimckpt.merge.plan import MergeError, MergeOptions
from slimckpt.storage import UnknownStorage, for_path, is_url

log = get_logger("slimckpt.merge")


def _bar(desc: str, total: int, progress: bool) -> tqdm:
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        disable=not progress or not sys.stderr.isatty(),
        file=sys.stderr,
    )


def is_remote(opts: MergeOptions) -> bool:
    return is_url(opts.local_dir) or is_url(opts.target_dir)


def _scratch_root(opts: MergeOptions, scratch_dir: str | None) -> str:
    if scratch_dir:
        return scratch_dir
    if not is_url(opts.target_dir):  # next to the output: the same filesystem, the room the merge checks
        return os.path.dirname(os.path.abspath(opts.target_dir))
    return tempfile.gettempdir()


def merge_remote(opts: MergeOptions, merge: Callable[[MergeOptions], object], scratch_dir: str | None = None):
    """Run `merge` (the pipeline's) for a remote source or target (see the module doc)."""
    if opts.distributed:
        raise MergeError(
            f"{opts.local_dir if is_url(opts.local_dir) else opts.target_dir}: a distributed merge reads and "
            f"writes a shared filesystem; run it without {opts.distributed_hint} for an s3:// source or target"
        )
    source, target = opts.local_dir, opts.target_dir
    try:
        for url in (u for u in (source, target) if is_url(u)):
            for_path(url).check_access(url)
    except (OSError, UnknownStorage) as exc:
        raise MergeError(str(exc)) from None
    root = _scratch_root(opts, scratch_dir)
    try:
        work = tempfile.mkdtemp(prefix=".slimckpt-merge-", dir=root)
    except OSError as exc:
        raise MergeError(f"{root}: cannot hold the merge's scratch dir ({exc}); pass --scratch_dir") from None
    names: dict[str, str] = {}
    try:
        if is_url(source):
            mirror = os.path.join(work, "source")
            names[mirror] = source
            try:
                total = sum(e.size for e in read_manifest(source).files)
                with _bar("fetch", total, opts.progress) as bar:
                    fetch_step(source, mirror, records=lambda d: records_of(d, [MODEL_PREFIX]), on_bytes=bar.update)
                log.info("fetched %s (%.1f MiB checked) into %s", source, total / 2**20, mirror)
            except UncommittedCheckpoint as exc:
                line = str(exc).removeprefix("slimckpt: ")
                raise MergeError(f"{line} (a merge reads only a committed, intact step)") from None
            opts.local_dir, opts.source_checked, opts.source_name, opts.lock_source = mirror, True, source, False
        if is_url(target):
            opts.target_dir = os.path.join(work, "output")
            names[opts.target_dir] = target
        result = merge(opts)
        if is_url(target):
            total = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(opts.target_dir) for n in names)
            with _bar("upload", total, opts.progress) as bar:
                upload_dir(
                    opts.target_dir,
                    target,
                    overwrite=opts.overwrite,
                    overwrite_hint=opts.overwrite_hint,
                    on_bytes=bar.update,
                )
            result.target_dir = target
        return result
    except (MergeError, CommitError, OSError) as exc:
        text = str(exc)
        for local, url in names.items():
            text = text.replace(local, url)
        raise MergeError(text) from None
    finally:
        opts.local_dir, opts.target_dir = source, target
        for_path(work).remove_tree(work, ignore_errors=True)


__all__ = ["is_remote", "merge_remote"]
