"""Drop the optimizer state of an old step, keeping its model, extra state and HF export
(retention's keep_optimizer_last; the record readers see: slimckpt.layout.dropped_optimizer).

Both formats our recipes write:

  incremental tier (dcp/)   model and optimizer chunks share each rank's `__r_0.distcp` file, so
      the files are rewritten: each one's model chunks are copied, 2 MiB at a time, into a new
      file in `dcp.slimckpt-drop/` (hashed as written), with a `.metadata` that no longer names
      the optimizer's keys (so no DCP reader can load zeros or stale bytes as Adam state). Then
      the manifest for the new files is written beside the old one (`slimckpt_resume.json.drop`),
      and the switch is three renames: dcp/ aside, the new dir in, the new manifest over the old.
      A kill before the first rename leaves the old committed step (readers ignore the two dirs;
      the new files are discarded at the next pass), one after the last the new one; one between
      the renames (two renames apart) leaves the step reported damaged until the next retention
      pass of the run finishes the renames (finish_interrupted). Cost: one read and one write of the step's model
      bytes (a third of the step) on the retention's rank, bounded host memory.
  verl's rank files          `optim_world_size_*_rank_*.pt` are deleted, after the record
      (slimckpt_optimizer_dropped.json) is written.

A model-only recipe's steps (quickstart, intermediate: save_contents [model]) have no optimizer
state: nothing to drop. The caller holds the role dir's exclusive lock (no reader is inside).
"""

from __future__ import annotations

# lazy imports: DCP's metadata reader loads only when a DCP step's optimizer is dropped (retention,
# which imports this module, is patched into every worker)
import dataclasses
import json
import os
import pickle
import re
import time
from typing import Any

from slimckpt import SlimckptError
from slimckpt.engine.checkpoint_dir import DCP_DIR
from slimckpt.engine.resume_records import atomic_write_text, write_manifest
from slimckpt.layout.dropped_optimizer import DROPPED_KEY, NATIVE_MARKER
from slimckpt.layout.merge_manifest import READ_CHUNK, new_hasher
from slimckpt.layout.resume_manifest import (
    DROP_DIRS,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    UncommittedCheckpoint,
    has_manifest,
    read_manifest,
    role_damage,
)
from slimckpt.log import get_logger
from slimckpt.storage import for_path

log = get_logger("slimckpt.retention")

NEW_DIR, OLD_DIR = (d.rstrip("/") for d in DROP_DIRS)  # not state to any reader (resume_manifest._not_state)
NEW_MANIFEST = f"{MANIFEST_NAME}.drop"
OPTIM_FILE = re.compile(r"^optim_world_size_\d+_rank_\d+\.pt$")
OPTIM_ROOT = "optim"  # the optimizer's part of the incremental tier's state dict ({"model", "optim"})


class NothingToDrop(SlimckptError):
    """The role dir holds no optimizer state (or is not a committed step): str() says why."""


def holds_optimizer(role_dir: str) -> bool:
    if os.path.isdir(os.path.join(role_dir, DCP_DIR)) or has_manifest(role_dir):
        try:
            return "optimizer" in read_manifest(role_dir).contents
        except UncommittedCheckpoint:
            return False
    try:
        return any(OPTIM_FILE.match(n) for n in os.listdir(role_dir))
    except OSError:
        return False


def drop_optimizer(role_dir: str, keep_optimizer_last: int | None = None) -> int:
    """Drop `role_dir`'s optimizer state; returns the bytes freed. Raises NothingToDrop when it has
    none, OSError when the disk refuses (the step is then left as it was, or finished next time)."""
    finish_interrupted(role_dir)
    if os.path.isdir(os.path.join(role_dir, DCP_DIR)) or has_manifest(role_dir):
        return _drop_dcp(role_dir, keep_optimizer_last)
    return _drop_native(role_dir, keep_optimizer_last)


# --------------------------------------------------------------------------- verl's rank files


def _drop_native(role_dir: str, keep_last: int | None) -> int:
    names = sorted(n for n in os.listdir(role_dir) if OPTIM_FILE.match(n))
    if not names:
        raise NothingToDrop("no optim_world_size_* files")
    freed = sum(os.path.getsize(os.path.join(role_dir, n)) for n in names)
    atomic_write_text(
        os.path.join(role_dir, NATIVE_MARKER),
        json.dumps(
            {DROPPED_KEY: True, "files": names, "bytes": freed, "keep_optimizer_last": keep_last, "at": time.time()}
        ),
    )
    store = for_path(role_dir)
    for name in names:
        store.remove(os.path.join(role_dir, name))
    store.sync(role_dir)
    return freed


# --------------------------------------------------------------------------- the incremental tier


def finish_interrupted(role_dir: str, said: bool = True) -> None:
    """Roll an interrupted drop forward (its new manifest was written) or back (it was not); the
    drop's own switch is this roll forward (`said` False: not logged)."""
    new_dir, old_dir = os.path.join(role_dir, NEW_DIR), os.path.join(role_dir, OLD_DIR)
    new_manifest = os.path.join(role_dir, NEW_MANIFEST)
    dcp_dir = os.path.join(role_dir, DCP_DIR)
    store = for_path(role_dir)
    if os.path.isfile(new_manifest):
        if os.path.isdir(new_dir):
            aside = old_dir if os.path.isdir(dcp_dir) else None
            store.atomic_publish(new_dir, dcp_dir, aside=aside, durable=False)  # synced with the manifest
        store.replace(new_manifest, os.path.join(role_dir, MANIFEST_NAME))
        store.sync(role_dir)
        if said:
            log.warning("retention finished the interrupted optimizer drop of %s", role_dir)
    elif os.path.isdir(new_dir):
        store.remove_tree(new_dir)  # the old step is still the committed one
    if os.path.isdir(old_dir):
        store.remove_tree(old_dir)
    if os.path.isfile(os.path.join(role_dir, NATIVE_MARKER)):
        for name in [n for n in os.listdir(role_dir) if OPTIM_FILE.match(n)]:
            store.remove(os.path.join(role_dir, name))


def _optim_key(fqn: str, planner_data: dict[str, Any]) -> bool:
    path = planner_data.get(fqn)
    return (path[0] == OPTIM_ROOT) if path else fqn.startswith(OPTIM_ROOT + ".")


def _copy_ranges(src: str, dst: str, ranges: list[tuple[int, int]], algo: str) -> str:
    """Append each [offset, offset+length) of `src` to a new `dst` in READ_CHUNK pieces; its checksum."""
    hasher = new_hasher(algo)
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
        for offset, length in ranges:
            fin.seek(offset)
            left = length
            while left > 0:
                n = fin.readinto(view[: min(len(buf), left)])
                if not n:
                    raise OSError(f"{src}: ended {left} bytes before a chunk its .metadata lists")
                fout.write(view[:n])
                hasher.update(view[:n])
                left -= n
        for_path(dst).sync_open(fout)
    return hasher.hexdigest()


def _drop_dcp(role_dir: str, keep_last: int | None) -> int:
    from slimckpt.engine.dcp_pickle import read_metadata

    manifest, damage = role_damage(role_dir, checksums=False)
    if manifest is None or damage:
        raise NothingToDrop(damage[0].message if damage else "no manifest")
    if "optimizer" not in manifest.contents:
        raise NothingToDrop(f"its manifest lists {'+'.join(manifest.contents)} only")
    dcp_dir = os.path.join(role_dir, DCP_DIR)
    meta = read_metadata(dcp_dir)
    planner = dict(getattr(meta, "planner_data", None) or {})
    kept_keys = {k for k in meta.state_dict_metadata if not _optim_key(k, planner)}
    by_file: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in meta.storage_data.items():
        if index.fqn in kept_keys:
            by_file.setdefault(info.relative_path, []).append((index, info))
    new_dir = os.path.join(role_dir, NEW_DIR)
    store = for_path(role_dir)
    store.remove_tree(new_dir, ignore_errors=True)
    store.make_dirs(new_dir)
    storage: dict[Any, Any] = {}
    entries: list[FileEntry] = []
    for rel, items in sorted(by_file.items()):
        items.sort(key=lambda t: t[1].offset)
        offset = 0
        for index, info in items:
            storage[index] = dataclasses.replace(info, offset=offset)
            offset += info.length
        checksum = _copy_ranges(
            os.path.join(dcp_dir, rel),
            os.path.join(new_dir, rel),
            [(info.offset, info.length) for _, info in items],
            manifest.checksum_algo,
        )
        entries.append(FileEntry(f"{DCP_DIR}/{rel}", offset, checksum))
    new_meta = dataclasses.replace(
        meta,
        state_dict_metadata={k: v for k, v in meta.state_dict_metadata.items() if k in kept_keys},
        storage_data=storage,
    )
    if getattr(meta, "planner_data", None) is not None:
        new_meta = dataclasses.replace(new_meta, planner_data={k: v for k, v in planner.items() if k in kept_keys})
    meta_path = os.path.join(new_dir, ".metadata")
    hasher = new_hasher(manifest.checksum_algo)
    data = pickle.dumps(new_meta)
    hasher.update(data)
    with open(meta_path, "wb") as f:
        f.write(data)
        f.flush()
        store.sync_open(f)
    entries.append(FileEntry(f"{DCP_DIR}/.metadata", len(data), hasher.hexdigest()))
    store.sync(new_dir)
    old_bytes = sum(e.size for e in manifest.files if e.path.startswith(f"{DCP_DIR}/"))
    files = [e for e in manifest.files if not e.path.startswith(f"{DCP_DIR}/")] + entries
    freed = old_bytes - sum(e.size for e in entries)
    extra = dict(manifest.extra)
    extra["bytes"] = sum(e.size for e in files)
    extra[DROPPED_KEY] = {"bytes": freed, "keep_optimizer_last": keep_last, "at": time.time()}
    new = Manifest(
        global_step=manifest.global_step,
        world_size=manifest.world_size,
        contents=[c for c in manifest.contents if c != "optimizer"],
        files=files,
        fsdp_version=manifest.fsdp_version,
        extra=extra,
        checksum_algo=manifest.checksum_algo,
    )
    write_manifest(role_dir, new, NEW_MANIFEST)
    finish_interrupted(role_dir, said=False)  # the switch: the renames a pass after a kill would make
    return freed


__all__ = ["NothingToDrop", "drop_optimizer", "finish_interrupted", "holds_optimizer"]
