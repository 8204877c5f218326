"""The commit of a step: what makes a written role dir loadable, on every rank at once.

Every rank lists and checksums the files it wrote; rank 0 adds every other file of the dir
(verl's huggingface/ ...), writes the manifest (write.resume_records, LAST: no manifest, no
load), then applies retention; every rank learns the outcome (collective.outcome): a failure on
any rank is raised on all of them, as the same CommitFailed. Until it returns no rank's save (or
background write) is over, so a load right after it on any rank finds the manifest rank 0 wrote.
Also here: what a step's dir is cleared of before it is written, and retention's hooks around
the commit (nothing is deleted before the new step is committed).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

import torch.distributed as dist

import slimckpt.save.export.direct as hf_direct_export
import slimckpt.save.retention.prune as retention
from slimckpt import SlimckptError
from slimckpt.dist import outcome
from slimckpt.engine import checkpoint_dir
from slimckpt.engine.checkpoint_dir import DCP_DIR
from slimckpt.engine.resume_records import commit_manifest as write_manifest  # never over a committed one
from slimckpt.engine.resume_records import remove_manifest
from slimckpt.layout.resume_manifest import (
    FAILED_PREFIX,
    FileEntry,
    Manifest,
    describe_files,
    unlisted_files,
)
from slimckpt.log import get_logger
from slimckpt.save.extra_state import EXTRA_NAME, EXTRA_PREFIX
from slimckpt.save.save_context import SaveContext
from slimckpt.save.state_dicts import LORA_ONLY_KEY
from slimckpt.save.target import SaveTarget
from slimckpt.storage import for_path

log = get_logger("slimckpt.resume")


class CommitFailed(SlimckptError, RuntimeError):
    """The commit of a step failed on some rank; every rank raises it with the same line."""


# --------------------------------------------------------------------------- files of a rank


def rank_files(local_path: str, rank: int, world: int) -> list[str]:
    """Files of the resume state this rank wrote, relative to `local_path`."""
    store = for_path(local_path)
    written = checkpoint_dir.rank_files(local_path, rank)
    out = [f for f in written if f.startswith(f"{DCP_DIR}/")]
    if rank == 0 and store.exists(os.path.join(local_path, DCP_DIR, ".metadata")):
        out.append(f"{DCP_DIR}/.metadata")
    extra = EXTRA_NAME.format(world=world, rank=rank)
    if extra in written:
        out.append(extra)
    if rank == 0 and store.exists(os.path.join(local_path, "fsdp_config.json")):
        out.append("fsdp_config.json")
    if rank == 0:  # huggingface/: verl's configs and tokenizer, the export's weights (every rank wrote rows)
        out += hf_direct_export.export_files(local_path)
    return out


def clear_stale(local_path: str) -> None:
    """Before (re)writing a step: uncommit it first, then drop what an earlier attempt left."""
    remove_manifest(local_path)
    store = for_path(local_path)
    store.remove_tree(os.path.join(local_path, DCP_DIR), ignore_errors=True)
    store.abort_uploads(local_path.rstrip("/") + "/")  # a killed writer's unfinished uploads (object stores)
    for name in store.list_dir(local_path) if store.is_dir(local_path) else []:
        if name.startswith(EXTRA_PREFIX) or name.startswith(FAILED_PREFIX):
            store.remove(os.path.join(local_path, name))


# --------------------------------------------------------------------------- retention


def make_room(target: SaveTarget, max_keep: int | None) -> list[str]:
    """Where verl's ensure_checkpoint_capacity deletes before a save: nothing is deleted until the
    new step is committed (slimckpt.save.retention.prune); returns the steps whose optimizer state goes
    before the new step is written (keep_optimizer_last)."""
    return retention.optimizer_drops(target.options, target.saved_paths, max_keep)


def drop_first(target: SaveTarget, drops: list[str]) -> Callable[[], None] | None:
    """The optimizer drops of make_room, run where the save writes (foreground, or the background
    writer before its shards: an async save's blocking time stays the same)."""
    if not drops:
        return None
    return functools.partial(retention.drop_before_save, drops, target.options.keep_optimizer_last)


def register_committed(target: SaveTarget, local_path: str, max_keep: int | None) -> None:
    """verl's register_checkpoint, run only after the commit: never deletes the tracker's step or a
    locked one (slimckpt.save.retention.prune)."""
    retention.after_save(target.state, target.options, target.saved_paths, local_path, max_keep)


# --------------------------------------------------------------------------- commit


def _failure_line(where: str, exc: BaseException) -> str:
    """The one line of a commit's failure on `where` (its OSError, if any, travels as the cause)."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{where}: {type(exc).__name__}: {first}"


def commit(ctx: SaveContext, known: dict[str, str] | None = None) -> None:
    """Every rank lists and checksums its files; rank 0 adds every other file of the dir (verl's
    huggingface/ ...), writes the manifest, then applies retention, and every rank learns the
    outcome: a failure on any rank is raised on all of them, as the same CommitFailed (caused by
    the same OSError where one was the cause, so every rank's save error names the same fix).
    Collective over `ctx.group`; the caller has finished all writes. `known`: checksums of the
    files hashed while written (DCP's); the rest (extra state, the export) is read back."""
    group = ctx.group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    t0 = time.perf_counter()

    def not_committed(failure: outcome.Failure) -> CommitFailed:
        return CommitFailed(f"slimckpt: step {ctx.step} at {ctx.local_path} was not committed: {failure.line}")

    mine = outcome.on_every_rank(
        group,
        lambda: [
            e.to_json() for e in describe_files(ctx.local_path, rank_files(ctx.local_path, rank, world), known=known)
        ],
        not_committed,
        describe=lambda exc: _failure_line(f"rank {rank}", exc),
    )
    gathered: list | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=dist.get_global_rank(group, 0), group=group)

    def on_rank0() -> None:
        try:
            _commit_on_rank0(ctx, [e for part in gathered or [] for e in part], world, t0)
        except Exception:
            log.debug("commit of step %s at %s failed on rank 0", ctx.step, ctx.local_path, exc_info=True)
            raise

    outcome.from_rank0(group, on_rank0, not_committed, describe=lambda exc: _failure_line("rank 0", exc))


def _commit_on_rank0(ctx: SaveContext, reported: list[dict], world: int, t0: float) -> None:
    files = [FileEntry.from_json(e) for e in reported]
    files += describe_files(ctx.local_path, unlisted_files(ctx.local_path, [f.path for f in files]))
    timings = ctx.timings
    timings["checksum"] = time.perf_counter() - t0  # rank 0's, gather included
    version = ctx.target.fsdp_version
    write_manifest(
        ctx.local_path,
        Manifest(
            global_step=int(ctx.step),
            world_size=world,
            contents=list(ctx.contents),
            files=files,
            fsdp_version=version,
            extra={
                "timings_s": timings,
                "bytes": sum(f.size for f in files),
                "aliases": dict(ctx.aliases or {}),
                **({LORA_ONLY_KEY: True} if ctx.lora_only else {}),
            },
        ),
    )
    register_committed(ctx.target, ctx.local_path, ctx.max_keep)
    log.info(
        "committed step %s at %s: %d files, %.1f MiB (%s)",
        ctx.step,
        ctx.local_path,
        len(files),
        sum(f.size for f in files) / 2**20,
        ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()),
    )


__all__ = ["CommitFailed", "clear_stale", "commit", "drop_first", "make_room", "rank_files", "register_committed"]
