"""The commit record of an incremental-tier resume state, and the tracker file. Pure: no torch.

A role directory (`<root>/global_step_N/actor`) holds resume state only once
`slimckpt_resume.json` is in it. The manifest is written last, after every rank's files are on
disk and fsynced, in one step (slimckpt.engine.resume_records writes it); a directory without it is
a save that never finished and is refused at load. It lists every file of the role directory with
its size and checksum (xxh3_128, the same check as a merge output's manifest.json:
manifest.check_file), and carries a checksum of itself (its seal), so a truncated, missing,
altered or unlisted file, or a damaged manifest, is caught before any tensor is read.
`role_damage` is the one definition of an intact role dir: the load, `slimckpt verify` and
resume_mode=auto's choice of step all ask it, and print its one line (`damage_message`) for the
first bad file. A manifest without its seal, of a format this slimckpt does not read, or missing
a field is damaged. Its files are the same records as a merge output's (`merge_manifest.FileEntry`);
slimckpt-resume/1, which spelled a file's size `bytes`, is still read.

`latest_checkpointed_iteration.txt` (verl's tracker) is written the same way: a temporary file,
fsync, rename. A reader sees the old step or the new one, never a torn write.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slimckpt import SlimckptError
from slimckpt.layout.merge_manifest import (
    DEFAULT_ALGO,
    BadFile,
    CommitError,
    FileEntry,
    check_file,
    check_seal,
    file_checksum,
    files_from_json,
    list_files,
    manifest_bytes,
)
from slimckpt.storage import absolute, for_path, is_file

MANIFEST_NAME = "slimckpt_resume.json"
FORMAT = "slimckpt-resume/2"
READ_FORMATS = ("slimckpt-resume/1", FORMAT)  # 1: a file's size spelled `bytes`
FAILED_PREFIX = "slimckpt_save_failed_rank_"
TRACKER_NAME = "latest_checkpointed_iteration.txt"
DAMAGED_FIX = "the checkpoint is damaged, resume from an earlier step"
NO_MANIFEST_FIX = "its save never finished: resume from an earlier step"
LOCK_SUFFIX = ".slimckpt-lock"  # slimckpt.storage.locks.LOCK_SUFFIX
# an optimizer drop's new files and the old ones it replaces (slimckpt.save.retention.optimizer_drop)
DROP_DIRS = ("dcp.slimckpt-drop/", "dcp.slimckpt-old/")


class UncommittedCheckpoint(SlimckptError, RuntimeError):
    """A step directory whose save did not finish (no manifest), or whose files do not match it."""


@dataclass
class Manifest:
    global_step: int
    world_size: int
    contents: list[str]
    files: list[FileEntry]
    fsdp_version: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    checksum_algo: str = DEFAULT_ALGO

    def to_bytes(self) -> bytes:
        record = {
            "format": FORMAT,
            "checksum_algo": self.checksum_algo,
            "global_step": self.global_step,
            "world_size": self.world_size,
            "fsdp_version": self.fsdp_version,
            "contents": list(self.contents),
            "files": [f.to_json() for f in self.files],
            "extra": self.extra,
            "committed_at": time.time(),
        }
        return manifest_bytes(record, self.checksum_algo)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        return cls(
            global_step=int(data["global_step"]),
            world_size=int(data["world_size"]),
            contents=list(data["contents"]),
            files=files_from_json(data["files"]),
            fsdp_version=data.get("fsdp_version"),
            extra=dict(data.get("extra") or {}),
            format=data["format"],
            checksum_algo=str(data["checksum_algo"]),
        )


def describe_files(root: str, relpaths: Iterable[str], known: dict[str, str] | None = None) -> list[FileEntry]:
    """Size and xxh3_128 of each file; `known` checksums (by relative path, computed while the
    file was written) are not re-read."""
    known = known or {}
    return [
        FileEntry(
            rel,
            for_path(root).size(os.path.join(root, rel)),
            known.get(rel) or file_checksum(os.path.join(root, rel), DEFAULT_ALGO),
        )
        for rel in relpaths
    ]


def _not_state(rel: str) -> bool:
    """Files a role dir may hold outside its manifest: the manifest (and its temp file), failure
    markers (reported on their own), advisory lock files of a subdir (slimckpt.storage.locks puts
    `.<dir>.slimckpt-lock` next to a dir), and the dirs of an optimizer drop under way."""
    name = rel.rsplit("/", 1)[-1]
    if name.endswith(LOCK_SUFFIX):
        return True
    if rel.startswith(DROP_DIRS):  # retention's optimizer drop in progress (save.optimizer_drop)
        return True
    return "/" not in rel and (name.startswith((MANIFEST_NAME, FAILED_PREFIX)))


def unlisted_files(role_dir: str, listed: Iterable[str]) -> list[str]:
    """Files under role_dir that no manifest entry (nor _not_state) accounts for."""
    known = set(listed)
    return [rel for rel in list_files(role_dir) if rel not in known and not _not_state(rel)]


def has_manifest(role_dir: str) -> bool:
    return is_file(os.path.join(role_dir, MANIFEST_NAME))


@dataclass(frozen=True)
class Damage:
    """One reason a role dir is not intact. `index` orders them the same on every rank (-1: the
    manifest itself, then the listed files, unlisted files, failure markers); `message` is the one
    line a refused load, `slimckpt verify` and resume_mode=auto's walk back print for it."""

    index: int
    file: str  # absolute path of the bad file
    reason: str
    message: str


def _manifest_damage(role_dir: str, reason: str) -> Damage:
    bad = BadFile(MANIFEST_NAME, reason)
    return Damage(-1, os.path.join(role_dir, MANIFEST_NAME), reason, damage_message(role_dir, bad))


def _parse_manifest(role_dir: str) -> tuple[Manifest | None, Damage | None]:
    path = os.path.join(role_dir, MANIFEST_NAME)
    if not has_manifest(role_dir):
        reason = "missing: its save never finished"
        return None, Damage(
            -1,
            path,
            reason,
            (
                f"slimckpt: {role_dir} has no {MANIFEST_NAME}: its save never finished; resume from an earlier "
                f"global_step_* (trainer.resume_mode=resume_path trainer.resume_from_path=...) or delete this directory"
            ),
        )
    try:
        with for_path(path).open_read(path) as f:
            data = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as exc:
        return None, _manifest_damage(role_dir, f"unreadable ({_one_line(exc)})")
    if not isinstance(data, dict):
        return None, _manifest_damage(role_dir, "unreadable (not a JSON object)")
    if data.get("format") not in READ_FORMATS:
        return None, _manifest_damage(
            role_dir,
            f"unknown format {data.get('format')!r} (this slimckpt reads {', '.join(map(repr, READ_FORMATS))})",
        )
    try:
        check_seal(data)
        return Manifest.from_json(data), None
    except (CommitError, KeyError, TypeError, ValueError, AttributeError) as exc:
        return None, _manifest_damage(role_dir, _one_line(exc))


def read_manifest(role_dir: str) -> Manifest:
    """The role dir's sealed manifest; UncommittedCheckpoint with one line if it has none or it is damaged."""
    manifest, bad = _parse_manifest(role_dir)
    if manifest is None:
        raise UncommittedCheckpoint(bad.message if bad else f"slimckpt: {role_dir}: no manifest; {NO_MANIFEST_FIX}")
    return manifest


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    return f"{type(exc).__name__}: {text}"[:200] if not isinstance(exc, CommitError) else text[:200]


def damage_message(role_dir: str, bad: BadFile) -> str:
    """The one line that both a refused load and `slimckpt verify` print for a damaged file."""
    return f"slimckpt: {os.path.join(role_dir, bad.name)}: {bad.reason}; {DAMAGED_FIX}"


def _check_entry(
    role_dir: str, entry: FileEntry, algo: str, checksums: bool, on_bytes: Callable[[int], object] | None
) -> str | None:
    reason = check_file(role_dir, entry.path, entry.size, entry.checksum, algo, checksums, on_bytes)
    return f"missing but listed in {MANIFEST_NAME}" if reason == "missing" else reason


def share_by_bytes(sizes: Sequence[int], world: int) -> list[int]:
    """Owner rank of each file: largest first to the rank with the fewest bytes so far, so the
    ranks of a load hash about equal shares. The same on every rank (same manifest)."""
    load = [0] * max(world, 1)
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(len(load)), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def find_damage(
    role_dir: str,
    manifest: Manifest,
    checksums: bool = True,
    on_bytes: Callable[[int], object] | None = None,
    share: tuple[int, int] = (0, 1),
    extras: bool = True,
) -> list[tuple[int, BadFile]]:
    """(index, bad file) for every listed file of this `share` (rank, world: the files
    share_by_bytes gives the rank) that is missing, resized or altered, then (with `extras`) files
    not in the manifest (index len(files) + k), and failure markers. Ordered by index, so every
    rank agrees which is first."""
    rank, world = share
    owner = share_by_bytes([e.size for e in manifest.files], world)
    bad: list[tuple[int, BadFile]] = []
    for i, entry in enumerate(manifest.files):
        if owner[i] == rank:
            reason = _check_entry(role_dir, entry, manifest.checksum_algo, checksums, on_bytes)
            if reason:
                bad.append((i, BadFile(entry.path, reason)))
    if extras:
        n = len(manifest.files)
        unlisted = unlisted_files(role_dir, (e.path for e in manifest.files))
        bad += [(n + k, BadFile(rel, f"not listed in {MANIFEST_NAME}")) for k, rel in enumerate(unlisted)]
        n += len(unlisted)
        bad += [
            (n + k, BadFile(os.path.basename(m), "says this step's save failed"))
            for k, m in enumerate(failure_markers(role_dir))
        ]
    return bad


def role_damage(
    role_dir: str,
    checksums: bool = True,
    on_bytes: Callable[[int], object] | None = None,
    share: tuple[int, int] = (0, 1),
    extras: bool = True,
) -> tuple[Manifest | None, list[Damage]]:
    """Is this role dir intact: (its manifest or None, what is wrong, first first). Intact means a
    manifest that parses, carries a matching seal and this format; every listed file there with its
    size and (`checksums`) checksum; and (`extras`) no unlisted file, no failure marker.
    `share` splits the listed files between the ranks of a load (find_damage). Reads each file
    once in 16 MiB chunks: memory stays bounded whatever the step's size."""
    manifest, bad = _parse_manifest(role_dir)
    if manifest is None:
        return None, [bad] if bad else []
    return manifest, [
        Damage(i, os.path.join(role_dir, b.name), b.reason, damage_message(role_dir, b))
        for i, b in find_damage(role_dir, manifest, checksums, on_bytes, share, extras)
    ]


def check_committed(role_dir: str, checksums: bool = True) -> Manifest:
    """role_damage in one process: raise UncommittedCheckpoint with the first bad file's line
    (what `slimckpt verify` prints for it), else the manifest."""
    manifest, damage = role_damage(role_dir, checksums)
    if damage or manifest is None:
        raise UncommittedCheckpoint(
            damage[0].message if damage else f"slimckpt: {role_dir}: no manifest; {NO_MANIFEST_FIX}"
        )
    return manifest


def check_files(role_dir: str, files: Sequence[FileEntry], checksums: bool, algo: str = DEFAULT_ALGO) -> None:
    """Raise UncommittedCheckpoint naming the first listed file that is missing, short or altered."""
    for entry in files:
        reason = _check_entry(role_dir, entry, algo, checksums, None)
        if reason:
            raise UncommittedCheckpoint(damage_message(role_dir, BadFile(entry.path, reason)))


def failure_markers(role_dir: str) -> list[str]:
    store = for_path(role_dir)
    if not store.is_dir(role_dir):
        return []
    return sorted(os.path.join(role_dir, n) for n in store.list_dir(role_dir) if n.startswith(FAILED_PREFIX))


# --------------------------------------------------------------------------- tracker


def read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER_NAME)
    try:
        with for_path(path).open_read(path) as f:
            return int(f.read().decode("utf-8", "replace").strip())
    except (FileNotFoundError, ValueError):
        return None


def step_of(role_dir: str) -> tuple[str, int] | None:
    """(`<root>`, N) for verl's layout `<root>/global_step_N/<role>`; None for any other path."""
    step_dir = os.path.dirname(absolute(role_dir).rstrip("/"))
    name = os.path.basename(step_dir)
    if not name.startswith("global_step_"):
        return None
    try:
        return os.path.dirname(step_dir), int(name[len("global_step_") :])
    except ValueError:
        return None


STEP_DIR = re.compile(r"^global_step_(\d+)$")


def saved_steps(root: str) -> list[int]:
    """The N of every `<root>/global_step_N` dir (any storage), ascending; [] when `root` cannot be listed."""
    try:
        names = for_path(root).list_dir(root)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(STEP_DIR.match, names) if m)


# --------------------------------------------------------------------------- retention


def protected_dirs(paths: Iterable[str]) -> set[str]:
    """Role dirs that retention must keep: those of the step the tracker names now. verl deletes old
    actor dirs while the tracker may still name one of them (before the critic and the tracker
    write are done, or before an async commit); a crash then leaves a tracker pointing at nothing."""
    protect: set[str] = set()
    for path in paths:
        where = step_of(path)
        if where is not None and read_tracker(where[0]) == where[1]:
            protect.add(absolute(path))
    return protect


def split_retention(paths: Sequence[str], keep: int | None, protect: set[str]) -> tuple[list[str], list[str]]:
    """(kept, deleted) for verl's list of saved role dirs, oldest first: the newest `keep` stay, and
    so does every dir in `protect` (it is deleted at a later save, once the tracker has moved on).
    keep None or <= 0 keeps everything, as verl's max_ckpt_to_keep does."""
    if not keep or keep <= 0 or len(paths) <= keep:
        return list(paths), []
    excess = list(paths[: len(paths) - keep])
    delete = [p for p in excess if absolute(p) not in protect]
    return [p for p in paths if p not in delete], delete
