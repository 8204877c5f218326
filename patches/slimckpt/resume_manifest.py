"""The commit record of an incremental-tier resume state, and the tracker file. Pure: no torch.

A role directory (`<root>/global_step_N/actor`) holds resume state only once
`slimckpt_resume.json` is in it. The manifest is written last, after every rank's files are on
disk and fsynced, by an atomic rename; a directory without it is a save that never finished and
is refused at load. It lists every file of the state with its size (and CRC32 with `verify`), so
a truncated or missing file is caught before any tensor is read.

`latest_checkpointed_iteration.txt` (verl's tracker) is written the same way: a temporary file,
fsync, rename. A reader sees the old step or the new one, never a torn write.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .manifest import fsync_path

MANIFEST_NAME = "slimckpt_resume.json"
FORMAT = "slimckpt-resume/1"
FAILED_PREFIX = "slimckpt_save_failed_rank_"
TRACKER_NAME = "latest_checkpointed_iteration.txt"
_CHUNK = 8 * 2**20


class UncommittedCheckpoint(RuntimeError):
    """A step directory whose save did not finish (no manifest), or whose files do not match it."""


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the role directory
    bytes: int
    crc32: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "bytes": self.bytes}
        if self.crc32 is not None:
            out["crc32"] = self.crc32
        return out


@dataclass
class Manifest:
    global_step: int
    world_size: int
    contents: list[str]
    files: list[FileEntry]
    fsdp_version: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "global_step": self.global_step,
            "world_size": self.world_size,
            "fsdp_version": self.fsdp_version,
            "contents": list(self.contents),
            "files": [f.to_json() for f in self.files],
            "extra": self.extra,
            "committed_at": time.time(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Manifest":
        return cls(
            global_step=int(data["global_step"]),
            world_size=int(data["world_size"]),
            contents=list(data["contents"]),
            files=[FileEntry(f["path"], int(f["bytes"]), f.get("crc32")) for f in data["files"]],
            fsdp_version=data.get("fsdp_version"),
            extra=dict(data.get("extra") or {}),
            format=data["format"],
        )


def crc32_of(path: str) -> int:
    """CRC32 of a file read in 8 MiB chunks (bounded memory)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def describe_files(root: str, relpaths: Iterable[str], checksums: bool) -> list[FileEntry]:
    return [
        FileEntry(rel, os.path.getsize(os.path.join(root, rel)),
                  crc32_of(os.path.join(root, rel)) if checksums else None)
        for rel in relpaths
    ]


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` so that a reader sees either the old file or the whole new one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def has_manifest(role_dir: str) -> bool:
    return os.path.isfile(os.path.join(role_dir, MANIFEST_NAME))


def write_manifest(role_dir: str, manifest: Manifest) -> str:
    path = os.path.join(role_dir, MANIFEST_NAME)
    atomic_write_text(path, json.dumps(manifest.to_json(), indent=1))
    return path


def remove_manifest(role_dir: str) -> None:
    """Un-commit a directory before it is written again (a re-save of the same step)."""
    path = os.path.join(role_dir, MANIFEST_NAME)
    if os.path.exists(path):
        os.remove(path)
        fsync_path(role_dir)


def read_manifest(role_dir: str) -> Manifest:
    path = os.path.join(role_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise UncommittedCheckpoint(
            f"slimckpt: {role_dir} has no {MANIFEST_NAME}: its save never finished; resume from an earlier "
            f"global_step_* (trainer.resume_mode=resume_path trainer.resume_from_path=...) or delete this directory"
        )
    with open(path) as f:
        data = json.load(f)
    if data.get("format") != FORMAT:
        raise UncommittedCheckpoint(
            f"slimckpt: {path} has format {data.get('format')!r}, this slimckpt reads {FORMAT!r}; "
            f"load it with the slimckpt version that wrote it"
        )
    return Manifest.from_json(data)


def check_files(role_dir: str, files: Sequence[FileEntry], checksums: bool) -> None:
    """Raise UncommittedCheckpoint naming the first file that is missing, short or corrupt."""
    for entry in files:
        path = os.path.join(role_dir, entry.path)
        if not os.path.isfile(path):
            raise UncommittedCheckpoint(f"slimckpt: {path} is missing but listed in {MANIFEST_NAME}; "
                                        f"the checkpoint is damaged, resume from an earlier step")
        size = os.path.getsize(path)
        if size != entry.bytes:
            raise UncommittedCheckpoint(f"slimckpt: {path} has {size} bytes, {MANIFEST_NAME} says {entry.bytes}; "
                                        f"the checkpoint is damaged, resume from an earlier step")
        if checksums and entry.crc32 is not None and crc32_of(path) != entry.crc32:
            raise UncommittedCheckpoint(f"slimckpt: {path} fails its CRC32 check; "
                                        f"the checkpoint is damaged, resume from an earlier step")


def failure_markers(role_dir: str) -> list[str]:
    if not os.path.isdir(role_dir):
        return []
    return sorted(os.path.join(role_dir, n) for n in os.listdir(role_dir) if n.startswith(FAILED_PREFIX))


def write_failure(role_dir: str, rank: int, message: str) -> None:
    """A background write that failed leaves a note, so whoever waits for the commit stops waiting."""
    os.makedirs(role_dir, exist_ok=True)
    atomic_write_text(os.path.join(role_dir, f"{FAILED_PREFIX}{rank}.txt"), message + "\n")


# --------------------------------------------------------------------------- tracker


def read_tracker(root: str) -> int | None:
    try:
        with open(os.path.join(root, TRACKER_NAME)) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def write_tracker(root: str, step: int) -> bool:
    """Point verl's tracker at `step` unless it already names a later one. True if written."""
    current = read_tracker(root)
    if current is not None and current >= step:
        return False
    atomic_write_text(os.path.join(root, TRACKER_NAME), str(int(step)))
    return True


def step_of(role_dir: str) -> tuple[str, int] | None:
    """(`<root>`, N) for verl's layout `<root>/global_step_N/<role>`; None for any other path."""
    step_dir = os.path.dirname(os.path.normpath(os.path.abspath(role_dir)))
    name = os.path.basename(step_dir)
    if not name.startswith("global_step_"):
        return None
    try:
        return os.path.dirname(step_dir), int(name[len("global_step_"):])
    except ValueError:
        return None


# --------------------------------------------------------------------------- retention


def protected_dirs(paths: Iterable[str]) -> set[str]:
    """Role dirs that retention must keep: those of the step the tracker names now. verl deletes old
    actor dirs while the tracker may still name one of them (before the critic and the tracker
    write are done, or before an async commit); a crash then leaves a tracker pointing at nothing."""
    protect: set[str] = set()
    for path in paths:
        where = step_of(path)
        if where is not None and read_tracker(where[0]) == where[1]:
            protect.add(os.path.abspath(path))
    return protect


def split_retention(paths: Sequence[str], keep: int | None, protect: set[str]) -> tuple[list[str], list[str]]:
    """(kept, deleted) for verl's list of saved role dirs, oldest first: the newest `keep` stay, and
    so does every dir in `protect` (it is deleted at a later save, once the tracker has moved on).
    keep None or <= 0 keeps everything, as verl's max_ckpt_to_keep does."""
    if not keep or keep <= 0 or len(paths) <= keep:
        return list(paths), []
    excess = list(paths[: len(paths) - keep])
    delete = [p for p in excess if os.path.abspath(p) not in protect]
    return [p for p in paths if p not in delete], delete
