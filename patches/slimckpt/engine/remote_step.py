"""A committed incremental step on a remote medium (an `s3://` prefix), brought into a local scratch
dir for the tools that map a step's files (merge, convert).

The merge and convert read a step's records through memory maps of local files, the way their
bound on host memory is kept. A remote step is mirrored into a scratch dir first, without ever
holding a file in memory:

    1. the manifest, checked as a load checks it (seal, sizes, no unlisted file, no failure
       marker: resume_manifest.role_damage), read from the remote medium itself
    2. the small files whole (DCP's .metadata, the extra state, huggingface/, fsdp_config.json)
    3. each rank file (.distcp) as a sparse local file of its full size holding only the records
       the tool reads (`records`: the model's for a merge, every one for a convert)
    4. every listed file's checksum, computed while it streams past once in READ_BLOCK pieces
       (what is not kept is hashed and dropped): a flipped byte is named by its remote URL, in the
       line `slimckpt verify` prints for it

Host memory: one READ_BLOCK per file in flight. Local disk: the records kept. The mirror is a
committed step again (its manifest copied as it is), so the local tools run on it unchanged; their
checksum check is skipped (`checked`: done here, and the sparse files would not match it).
"""

from __future__ import annotations

# lazy imports: torch's DCP metadata types load only when a rank file's records are chosen (the merge imports torch anyway)
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from slimckpt.engine.checkpoint_dir import DCP_DIR
from slimckpt.layout.merge_manifest import BadFile, new_hasher
from slimckpt.layout.resume_manifest import (
    MANIFEST_NAME,
    Manifest,
    UncommittedCheckpoint,
    check_committed,
    damage_message,
)
from slimckpt.storage import for_path

READ_BLOCK = 8 << 20
FILES_AT_ONCE = 4
METADATA = f"{DCP_DIR}/.metadata"

# what a tool reads of a rank file: None for every byte, else [offset, end) ranges
Ranges = list[tuple[int, int]] | None


def _is_rank_file(rel: str) -> bool:
    return rel.startswith(f"{DCP_DIR}/") and rel.endswith(".distcp")


def records_of(local_dcp_dir: str, prefixes: Iterable[str]) -> dict[str, list[tuple[int, int]]]:
    """{rank file name: [offset, end) of each record whose key starts with one of `prefixes`, and of
    every bytes record (its pickle is checked before a load)}, from the mirrored `.metadata`."""
    from slimckpt.engine.dcp_pickle import byte_record_keys, read_metadata

    metadata = read_metadata(local_dcp_dir)
    pickled = byte_record_keys(metadata)
    prefixes = tuple(prefixes)
    out: dict[str, list[tuple[int, int]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn.startswith(prefixes) or index.fqn in pickled:
            out.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
    return out


def _copy(
    url: str, local: str, size: int, keep: Ranges, hasher, on_bytes: Callable[[int], object] | None
) -> str | None:
    """`url` into `local` (sparse: only `keep`), hashed whole when `hasher` is given; the hex digest."""
    store = for_path(url)
    out = for_path(local).create_ranges(local, size, sparse=True)
    try:
        if hasher is None:  # only the kept ranges cross the network
            for begin, end in keep if keep is not None else [(0, size)]:
                at = begin
                while at < end:
                    data = store.read_range(url, at, min(READ_BLOCK, end - at))
                    if not data:
                        raise OSError(f"{url}: ended at byte {at}, its manifest says {size}")
                    out.write(data, at)
                    at += len(data)
                    if on_bytes is not None:
                        on_bytes(len(data))
            return None
        with store.open_read(url) as f:
            at = 0
            while at < size:
                data = f.read(min(READ_BLOCK, size - at))
                if not data:
                    break
                hasher.update(data)
                for begin, end in keep if keep is not None else [(0, size)]:
                    lo, hi = max(begin, at), min(end, at + len(data))
                    if lo < hi:
                        out.write(memoryview(data)[lo - at : hi - at], lo)
                at += len(data)
                if on_bytes is not None:
                    on_bytes(len(data))
        return hasher.hexdigest()
    finally:
        out.close()


def fetch_step(
    url: str,
    local_dir: str,
    records: Callable[[str], dict[str, list[tuple[int, int]]]] | None = None,
    checksums: bool = True,
    on_bytes: Callable[[int], object] | None = None,
) -> Manifest:
    """Mirror the committed role dir `url` into `local_dir` (made here; see the module doc) and return
    its manifest. `records(local_dcp_dir)`: the ranges of each rank file to keep (None: every byte).
    Raises UncommittedCheckpoint with verify's line for the first bad file (named by its URL)."""
    manifest = check_committed(url, checksums=False)
    os.makedirs(local_dir, exist_ok=True)
    entries = {e.path: e for e in manifest.files}
    small = [e for e in manifest.files if not _is_rank_file(e.path)]
    ranks = [e for e in manifest.files if _is_rank_file(e.path)]

    def one(rel: str, keep: Ranges) -> None:
        entry = entries[rel]
        local = os.path.join(local_dir, rel)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        hasher = new_hasher(manifest.checksum_algo) if checksums else None
        got = _copy(os.path.join(url, rel), local, entry.size, keep, hasher, on_bytes)
        if got is not None and got != entry.checksum:
            reason = f"{manifest.checksum_algo} {got}, manifest says {entry.checksum}"
            raise UncommittedCheckpoint(damage_message(url, BadFile(rel, reason)))

    with ThreadPoolExecutor(FILES_AT_ONCE) as pool:
        for done in [pool.submit(one, e.path, None) for e in small]:
            done.result()
        keep = records(os.path.join(local_dir, DCP_DIR)) if records is not None and METADATA in entries else {}
        jobs = [
            pool.submit(one, e.path, None if records is None else keep.get(e.path.split("/", 1)[1], [])) for e in ranks
        ]
        for done in jobs:
            done.result()
    # the manifest last, as it was written: the mirror is a committed step
    with for_path(url).open_read(os.path.join(url, MANIFEST_NAME)) as f:
        data = f.read()
    with open(os.path.join(local_dir, MANIFEST_NAME), "wb") as out:
        out.write(data)
    return manifest


__all__ = ["READ_BLOCK", "fetch_step", "records_of"]
