"""A save that fails (disk full, read-only or unwritable directory, another writer) stops training
or lets it go on, as `checkpoint.on_save_error` says, and never leaves a step that looks committed.

Every recipe's save runs inside `guarded_save`:
  - rank 0 takes the exclusive writer lock of the role dir (slimckpt.storage.locks) and tells the other
    ranks, so a second trainer saving the same step into the same `default_local_dir` fails
    before writing a byte, on every rank, naming the holder;
  - a failure becomes one line naming the path and the fix (the errno is dug out of torch's and
    DCP's wrappers; torch.save reports a full disk as "file write failed", so the free space of
    the filesystem is added when no errno is found);
  - the role dir gets a failure marker (resume_records.write_failure): the incremental loader
    refuses it, the tracker is put back (resume_tracker), retention never counts it (a failed
    save never reaches verl's register_checkpoint);
  - on_save_error=stop raises SaveFailed; continue logs the line at ERROR and returns. A lock
    conflict always stops: two runs writing one directory is a misconfiguration, and going on
    would silently save nothing for the rest of the run. So does a lost rank (a collective failed
    because a peer was killed or stalled past the group's timeout): the group is broken, and the
    line names the rank (slimckpt.dist.heartbeat); every later save of the process (another role's,
    whose group would be made or used with the lost rank) fails at once with it (lost_rank).

Caveat of continue: it needs every rank to fail the same way (a full or read-only filesystem,
a lock conflict: all ranks see it). A failure on one rank only, inside verl's save, leaves the
other ranks in verl's barrier; that is verl's collective, not slimckpt's to unwind.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from slimckpt import SlimckptError
from slimckpt.dist import outcome
from slimckpt.dist.heartbeat import causes, in_a_job
from slimckpt.dist.lost_rank import RankLost, already_lost, peer_loss_line
from slimckpt.engine.checkpoint_dir import rank_files
from slimckpt.engine.resume_records import atomic_write_text, write_failure
from slimckpt.layout.resume_manifest import TRACKER_NAME, failure_markers, has_manifest, read_tracker
from slimckpt.log import get_logger
from slimckpt.save.modes.registry import mode_for
from slimckpt.save.modes.writer import writer_for
from slimckpt.save.os_fixes import trainer_fixes
from slimckpt.save.process_group import checkpoint_group
from slimckpt.save.target import SaveTarget
from slimckpt.storage import absolute, for_path, is_url
from slimckpt.storage.locks import LockBusy, acquire
from slimckpt.storage.os_errors import describe_os_error, redescribe
from slimckpt.storage.s3_errors import S3Error

log = get_logger("slimckpt.save")

POLICIES = ("stop", "continue")


class SaveFailed(SlimckptError, RuntimeError):
    """A checkpoint save failed; str() is the one-line message (path and fix)."""


def root_os_error(exc: BaseException) -> OSError | None:
    for e in causes(exc):
        if isinstance(e, OSError) and e.errno is not None:
            return e
    return None


def _os_line(exc: BaseException, local_path: str) -> str | None:
    """The OS error under `exc` with the trainer's fixes: one a writer described (the export's
    files, a commit's rename) or a bare OSError (torch's, DCP's)."""
    fixes = trainer_fixes(local_path)
    for e in causes(exc):
        line = redescribe(e, fixes)
        if line is not None:
            return line
    os_err = root_os_error(exc)
    return describe_os_error(os_err, local_path, fixes=fixes) if os_err is not None else None


def _free_bytes(path: str) -> int | None:
    if is_url(path):
        return for_path(path).free_bytes(path)
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return for_path(path or "/").free_bytes(path or "/")
    except OSError:
        return None


def describe_save_error(exc: BaseException, local_path: str, step: int) -> str:
    """One line: what failed, where, and what to do."""
    head = f"slimckpt: saving step {step} to {local_path} failed"
    if isinstance(exc, (LockBusy, SaveFailed)):
        return str(exc)
    for e in causes(exc):
        if isinstance(e, S3Error):  # already one line naming the object and the fix (throttled past the retries,
            return f"{head}: {e}"  # credentials refused...): an errno's generic words would lose the fix
    line = _os_line(exc, local_path)
    if line is not None:
        return f"{head}: {line}"
    first = (str(exc).strip().splitlines() or [""])[0]
    free = _free_bytes(local_path)
    hint = ""
    if "trainer.default_local_dir" in first:  # already in a trainer's words (the intermediate tier's export)
        pass
    elif free is not None and free < 64 * 2**20:
        hint = f" ({free / 2**20:.1f} MiB free on that filesystem: likely full; {trainer_fixes(local_path).full})"
    elif "unexpected pos" in first or "file write failed" in first:
        # torch.save's writer drops the errno: a short write is a full disk, a quota or a file size limit
        hint = " (a short write: check free space, quota and the file size limit `ulimit -f` there)"
    return f"{head}: {type(exc).__name__}: {first}{hint}"


def _group_of(target: SaveTarget):
    if not in_a_job():
        return None
    return checkpoint_group(target.state)


def _alone(
    group,
    step: Callable[[], Any],
    error: outcome.ErrorFactory,
    describe: Callable[[BaseException], str],
    catch: tuple[type[BaseException], ...],
    kind_of: Callable[[BaseException], str],
) -> Any:
    """outcome.from_rank0's outcome for a job of one process: no collective to tell it."""
    try:
        return step()
    except catch as exc:
        outcome.raise_failure(outcome.failure_of(exc, 0, describe, kind_of(exc)), error)


def take_writer_lock(target: SaveTarget, local_path: str, step: int):
    """Rank 0 locks the role dir for writing; every rank raises the same LockBusy if it cannot."""
    group = _group_of(target)
    if group is not None and mode_for(target.options).background:
        writer_for(target.state).wait()  # the background write of the previous step uses this group: finish it first
    held: list[Any] = []

    def lock_on_rank0() -> None:  # the lock stays here: every rank gets only the outcome
        parent = os.path.dirname(absolute(local_path).rstrip("/"))
        for_path(parent).make_dirs(parent, exist_ok=True)
        held.append(
            acquire(
                local_path,
                exclusive=True,
                what=f"saving step {step} (rank 0 of a trainer)",
                fix="another trainer is saving this step into the same trainer.default_local_dir; "
                "give each run its own default_local_dir",
            )
        )

    def busy_or_failed(failure: outcome.Failure) -> BaseException:
        return LockBusy(failure.line) if failure.kind == "busy" else SaveFailed(failure.line)

    (outcome.from_rank0 if group is not None else _alone)(
        group,
        lock_on_rank0,
        busy_or_failed,
        describe=lambda exc: str(exc) if isinstance(exc, LockBusy) else describe_save_error(exc, local_path, step),
        catch=(LockBusy, OSError),
        kind_of=lambda exc: "busy" if isinstance(exc, LockBusy) else "os",
    )
    return held[0] if held else None


def mark_failed(local_path: str, rank: int, line: str) -> None:
    try:
        if not write_failure(local_path, rank, line):
            log.warning(
                "the save of %s failed after its manifest was written: the step stays committed (%s)", local_path, line
            )
    except OSError as exc:  # the directory itself is what failed (read-only, gone): say so once
        log.debug("could not write the failure marker in %s: %s", local_path, exc)


def discard_rank_files(local_path: str, rank: int) -> None:
    """This rank's shard files of a failed save: they are useless and take the space a full disk
    needs for the next save. Kept once the manifest is written (resume_records.write_failure):
    they are a committed step's."""
    try:
        if has_manifest(local_path):
            return
        names = rank_files(local_path, rank)
    except OSError:  # the storage itself is what failed (a server gone, credentials revoked): the save's line says it
        return
    for name in names:
        try:
            for_path(local_path).remove(os.path.join(local_path, name))
        except OSError:
            pass


def guarded_save(target: SaveTarget, local_path: str, step: int, save: Callable[[], Any]) -> Any:
    """Run `save` under the writer lock; on failure mark the dir failed, then stop or continue."""
    policy = target.options.on_save_error
    state = target.state
    state.save_failed = None
    lock = None
    earlier = already_lost(local_path, step)
    try:
        if earlier is not None:
            raise RankLost(earlier)
        lock = take_writer_lock(target, local_path, step)
        return save()
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        lost = earlier or peer_loss_line(exc, local_path, step)
        line = lost or describe_save_error(exc, local_path, step)
        state.save_failed = line
        if not isinstance(exc, LockBusy):  # a dir another trainer is writing is not ours to touch
            discard_rank_files(local_path, target.rank)
            mark_failed(local_path, target.rank, line)
        if policy == "continue" and not isinstance(exc, LockBusy) and lost is None:
            log.error(
                "CHECKPOINT NOT SAVED (rank %s, on_save_error=continue, training goes on; the last committed "
                "step stays the resume point): %s",
                target.rank,
                line,
            )
            return None
        raise SaveFailed(line) from exc
    finally:
        if lock is not None:
            lock.release()


def restore_tracker(root: str, step: int, previous: int | None) -> bool:
    """Driver side, after the trainer's `_save_checkpoint`: if a role dir of `step` holds a failure
    marker, put latest_checkpointed_iteration.txt back to `previous` (the trainer wrote `step`).
    True if it did."""
    step_dir = os.path.join(root, f"global_step_{step}")
    store = for_path(step_dir)
    roles = (
        sorted(n for n in store.list_dir(step_dir) if store.is_dir(os.path.join(step_dir, n)))
        if store.is_dir(step_dir)
        else []
    )
    failed = [m for role in roles for m in failure_markers(os.path.join(step_dir, role))]
    if not failed or read_tracker(root) != step:
        return False
    tracker = os.path.join(root, TRACKER_NAME)
    if previous is None:
        for_path(tracker).remove(tracker)
    else:
        atomic_write_text(tracker, str(int(previous)))
    log.error(
        "step %s was not saved (see %s): latest_checkpointed_iteration.txt stays at %s", step, failed[0], previous
    )
    return True


def save_then_restore_tracker(trainer, original, *args, **kwargs):
    """The trainer's synchronous `_save_checkpoint`, then `restore_tracker` (on_save_error=continue
    returns from a failed worker save, and verl then writes the tracker)."""
    root = trainer.config.trainer.default_local_dir
    previous = read_tracker(root)
    result = original(trainer, *args, **kwargs)
    restore_tracker(root, int(trainer.global_steps), previous)
    return result


__all__ = [
    "POLICIES",
    "SaveFailed",
    "describe_save_error",
    "guarded_save",
    "mark_failed",
    "restore_tracker",
    "root_os_error",
    "save_then_restore_tracker",
    "take_writer_lock",
    "trainer_fixes",
]
