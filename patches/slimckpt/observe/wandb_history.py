"""Read the logged history of wandb runs: offline run directories and online run paths.

wandb 0.31 ships no Python reader for its offline `run-<id>.wandb` files any more (the Go core
writes them), but the format is stable and small: a 7-byte file header (":W&B", a 2-byte magic,
a version byte) followed by LevelDB-style log blocks of 32 KiB; each block holds chunks with a
7-byte header (4-byte checksum, 2-byte little-endian length, 1-byte type: full, first, middle,
last) and a block tail shorter than a chunk header is zero padding. Each reassembled record is a
`wandb.proto.wandb_internal_pb2.Record`; its `history` records carry `step` and items whose
`value_json` is the logged value. Checksums are not verified (the standard library has no
CRC32C); a run killed mid-write ends with a truncated chunk, which ends the scan.

Online runs (`entity/project/run_id`) go through `wandb.Api().run(path).scan_history()`.
"""

# lazy imports: wandb (seconds to import) only when a run's history is read through it
from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from slimckpt import SlimckptError

FILE_HEADER = 7
FILE_IDENT = b":W&B"
BLOCK = 32768
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class HistoryError(SlimckptError):
    """A run that cannot be read; str() names the path and the reason."""


def iter_records(path: str | os.PathLike) -> Iterator[bytes]:
    """Serialized records of a `.wandb` file, in write order."""
    data = Path(path).read_bytes()
    if len(data) < FILE_HEADER or data[:4] != FILE_IDENT:
        raise HistoryError(
            f"{path}: not a wandb run file (no ':W&B' header); pass a run-*.wandb file or its run directory"
        )
    pos = FILE_HEADER
    pending: list[bytes] = []
    while pos + CHUNK_HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < CHUNK_HEADER:
            pos += left_in_block  # zero padding at the end of a block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        start = pos + CHUNK_HEADER
        if kind == 0 and length == 0:
            pos += left_in_block  # preallocated zeros: nothing more in this block
            continue
        if start + length > len(data) or kind not in (FULL, FIRST, MIDDLE, LAST):
            return  # truncated tail of a run that was killed while writing
        chunk = data[start : start + length]
        pos = start + length
        if kind == FULL:
            pending = []
            yield chunk
        elif kind == FIRST:
            pending = [chunk]
        elif kind == MIDDLE:
            pending.append(chunk)
        else:
            pending.append(chunk)
            yield b"".join(pending)
            pending = []


@dataclass
class RunHistory:
    """One curve source: {step: {key: value}} merged from one or more wandb runs."""

    name: str
    sources: list[str] = field(default_factory=list)
    rows: dict[int, dict[str, float]] = field(default_factory=dict)

    def add(self, step: int, values: dict[str, float]) -> None:
        # a later run (a resume) overwrites what an earlier one logged at the same step
        self.rows.setdefault(step, {}).update(values)

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(s, row[key]) for s, row in sorted(self.rows.items()) if key in row]

    def keys(self) -> set[str]:
        return {k for row in self.rows.values() for k in row}

    def last_step(self) -> int | None:
        return max(self.rows) if self.rows else None


def _number(value_json: str) -> float | None:
    try:
        value = json.loads(value_json)
    except ValueError:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def read_offline_run(run_dir: str | os.PathLike, into: RunHistory) -> None:
    """Add the numeric history of one offline run directory (`offline-run-*`) to `into`."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(Path(run_dir).glob("run-*.wandb"))
    if not files:
        raise HistoryError(f"{run_dir}: no run-*.wandb file; pass a wandb offline run directory (wandb/offline-run-*)")
    record = pb.Record()
    for raw in iter_records(files[0]):
        try:
            record.ParseFromString(raw)
        except Exception:  # noqa: BLE001 - a damaged record: skip it, keep the rest
            continue
        if record.WhichOneof("record_type") != "history":
            continue
        values: dict[str, float] = {}
        step = record.history.step.num if record.history.HasField("step") else None
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            number = _number(item.value_json)
            if number is not None:
                values[key] = number
        if step is None:
            step = int(values.get("_step", -1))
        if step >= 0:
            into.add(int(step), {k: v for k, v in values.items() if not k.startswith("_")})
    into.sources.append(str(run_dir))


def run_dirs(path: str | os.PathLike) -> list[Path]:
    """An offline run dir itself, or every `offline-run-*` / `run-*` dir below `path` (a WANDB_DIR
    or its `wandb/` folder), oldest first (the dir names start with the start time)."""
    path = Path(path)
    if list(path.glob("run-*.wandb")):
        return [path]
    found = [p.parent for p in path.glob("**/run-*.wandb") if p.parent.name.startswith(("offline-run-", "run-"))]
    return sorted(set(found), key=lambda p: p.name.split("-", 1)[1] if "-" in p.name else p.name)


def read_online_run(run_path: str, into: RunHistory) -> None:
    import wandb

    try:
        run = wandb.Api().run(run_path)
        rows = run.scan_history()
        for row in rows:
            step = row.get("_step")
            if step is None:
                continue
            values = {
                k: float(v)
                for k, v in row.items()
                if not k.startswith("_") and isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            into.add(int(step), values)
    except Exception as exc:  # noqa: BLE001 - network, auth, missing run: one line for the user
        raise HistoryError(f"{run_path}: cannot read the online run ({type(exc).__name__}: {exc})") from None
    into.sources.append(run_path)


def load(spec: str) -> RunHistory:
    """`[LABEL=]PATH[,PATH...]`: PATHs are offline run dirs, dirs holding them, or online run paths
    (entity/project/run_id); all are joined into one curve in the order given."""
    label, sep, paths = spec.partition("=")
    if not sep or "/" in label:  # no label (a label has no '/'; a path may contain '=')
        label, paths = "", spec
    parts = [p for p in paths.split(",") if p]
    if not parts:
        raise HistoryError(f"{spec!r}: no run path given; give a run directory or entity/project/run_id")
    history = RunHistory(name=label or Path(parts[0].rstrip("/")).name)
    for part in parts:
        if os.path.exists(part):
            dirs = run_dirs(part)
            if not dirs:
                raise HistoryError(
                    f"{part}: no wandb run below this directory (looked for run-*.wandb); "
                    f"pass the run's wandb/ directory"
                )
            for d in dirs:
                read_offline_run(d, history)
        elif part.count("/") == 2:
            read_online_run(part, history)
        else:
            raise HistoryError(
                f"{part}: neither a directory nor an online run path; give a run directory or entity/project/run_id"
            )
    if not history.rows:
        raise HistoryError(f"{spec}: the run(s) logged no numeric history; pass a run that logged its metrics")
    return history


def finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]
