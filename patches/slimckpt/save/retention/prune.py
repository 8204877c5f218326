"""Retention (`max_actor_ckpt_to_keep`, `max_critic_ckpt_to_keep`): old steps are deleted only
after a new one is complete, never the step the tracker names, never one a reader has locked.

verl 0.9.1's BaseCheckpointManager does two things: `ensure_checkpoint_capacity` at the START of
a save deletes down to max_keep-1 steps (with max_keep >= 2), and `register_checkpoint` at the end
deletes down to max_keep. Both run on the worker before the trainer moves
`latest_checkpointed_iteration.txt`, and neither looks at it, at a reader, or at whether the
save of a step it keeps had finished. So with max_keep=2, a step whose actor saved but whose
critic failed (tracker still on the previous one) and one more save: the previous step, the one
the tracker names, is deleted before the new save has written a byte; a crash now leaves a
tracker pointing at nothing. With max_keep=1 the end-of-save delete removes the tracker's step
before the trainer has written the tracker (or data.pt). A `slimckpt merge` reading an old step
has it deleted under it.

Policy here (every recipe; verl's format and the incremental tier's):
  - nothing is deleted before a save (`before_save` is a no-op): a failed save leaves every
    committed step; while a step is written disk holds one step more than verl's order would
    (below).
  - after a save is complete (verl: its save returned; incremental: the manifest is written),
    the newest max_keep stay; of the older ones, the step the tracker names stays too (it goes at
    a later save, once the tracker has moved on), and so does any a reader or writer has locked
    (slimckpt.storage.locks; logged, retried at the next save).
  - an incremental dir loses its manifest before its files, so a delete cut short never leaves a
    dir that looks committed.
  - with a recipe's keep_best / best_metric, the best steps by a logged metric stay as well
    (slimckpt.save.retention.best_metric records the metric next to each step); with keep_optimizer_last,
    kept steps older than the newest N lose their optimizer state only (slimckpt.save.retention.optimizer_drop,
    under the same exclusive lock as a delete; the tracker's step keeps it). The decision itself is
    slimckpt.layout.retention_plan, pure.

Disk at the peak, per role (`peak_steps`, `verl_peak_steps`; `slimckpt plan` prints the bytes): the
peak is while a new step is written. verl holds max_keep steps then (max_keep-1 kept at the start,
plus the new one), 2 at max_keep=1. slimckpt holds one step more: max_keep+1 (the newest max_keep,
all complete, plus the new one), and at max_keep=1 always 3: the actor's retention runs inside its
save, before the trainer moves the tracker, so the previous step is still the tracker's and stays
until the next save. With max_keep >= 2 one more (max_keep+2) when the tracker names a step older
than the newest max_keep at a commit: a failed save with on_save_error=continue, or an async
commit that comes before the watcher has named the step before it. A step a reader has locked
adds one each while the lock is held.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

from slimckpt.engine.resume_records import remove_manifest
from slimckpt.layout import retention_plan
from slimckpt.layout.resume_manifest import protected_dirs
from slimckpt.layout.retention_plan import RetentionPolicy
from slimckpt.log import get_logger
from slimckpt.options.checkpoint_options import CheckpointOptions
from slimckpt.save.retention import best_metric, earlier_steps, optimizer_drop
from slimckpt.save.target import TargetState
from slimckpt.storage import absolute, for_path
from slimckpt.storage.locks import try_exclusive

log = get_logger("slimckpt.retention")


def _valid_keep(max_keep) -> int | None:
    return max_keep if isinstance(max_keep, int) and max_keep > 0 else None


def peak_steps(max_keep) -> tuple[int, int] | None:
    """Role dirs of one role on disk while a new step is written, under this policy: (usual, with the
    tracker behind), or None when max_keep keeps everything (None, or not a whole number > 0)."""
    keep_n = _valid_keep(max_keep)
    if keep_n is None:
        return None
    if keep_n == 1:
        return 3, 3  # the previous step is the tracker's when retention runs
    return keep_n + 1, keep_n + 2


def verl_peak_steps(max_keep) -> int | None:
    """The same for verl 0.9.1's order (ensure_checkpoint_capacity down to max_keep-1 before a save,
    nothing before a save at max_keep=1); None when it keeps everything."""
    keep_n = _valid_keep(max_keep)
    return None if keep_n is None else max(keep_n, 2)


def _exclusive(abs_path: str, what: str):
    """(the exclusive lock on a role dir, None) or (None, why retention leaves the dir as it is).

    The tracker is read again under the lock: an async commit's watcher (save/driver/tracker) may have
    named the step since retention decided, and it names a step only under the shared lock."""
    try:
        lock = try_exclusive(abs_path, what)
    except OSError as exc:
        return None, f"cannot lock it ({exc.strerror or exc})"
    if lock is None:
        return None, "a reader or writer holds its lock"
    if protected_dirs([abs_path]):
        lock.release()
        return None, "latest_checkpointed_iteration.txt names it now"
    return lock, None


def delete_step_dir(path: str) -> str | None:
    """Delete a role dir under an exclusive lock; None when done, else why it was kept."""
    abs_path = absolute(path)
    if not for_path(abs_path).exists(abs_path):
        return None
    lock, why = _exclusive(abs_path, "deleting it (retention)")
    if lock is None:
        return why
    with lock:
        try:
            remove_manifest(abs_path)  # uncommit first: a delete cut short leaves no committed-looking dir
        except OSError as exc:
            return f"cannot remove its manifest ({exc.strerror or exc})"
        errors = for_path(abs_path).remove_tree(abs_path, ignore_errors=True)
    return f"partly deleted: {errors[0]}" if errors else None


def policy_for(config: CheckpointOptions, max_keep) -> RetentionPolicy:
    """The role's policy: a recipe's checkpoint config adds keep_optimizer_last and keep_best."""
    keep_n = _valid_keep(max_keep)
    return RetentionPolicy(
        max_keep=keep_n,
        optimizer_last=config.keep_optimizer_last,
        keep_best=int(config.keep_best or 0),
        best_metric=config.best_metric or None,
        best_mode=str(config.best_mode or "max"),
    )


def drop_step_optimizer(path: str, keep_last: int | None) -> str | None:
    """Drop a role dir's optimizer state under its exclusive lock; None when done (or there was
    none), else why it was kept."""
    abs_path = absolute(path)
    if not os.path.isdir(abs_path) or not optimizer_drop.holds_optimizer(abs_path):
        return None
    lock, why = _exclusive(abs_path, "dropping its optimizer state (retention)")
    if lock is None:
        return why
    with lock:
        try:
            freed = optimizer_drop.drop_optimizer(abs_path, keep_last)
        except optimizer_drop.NothingToDrop as why:
            log.info("retention left %s as it is: %s", abs_path, why)
            return None
        except OSError as exc:
            return f"cannot drop its optimizer state ({exc.strerror or exc})"
    log.info(
        "retention dropped the optimizer state of %s (%.1f MiB freed; model, extra state and export kept)",
        abs_path,
        freed / 2**20,
    )
    return None


def apply(
    paths: Sequence[str], max_keep, policy: RetentionPolicy | None = None, spare: Sequence[str] = ()
) -> tuple[list[str], list[str]]:
    """(still tracked, deleted) for verl's list of saved role dirs, oldest first, after the newest
    one is complete. Deletes on disk, and drops the optimizer state the policy says to, except the
    optimizer state of the dirs in `spare`."""
    paths = list(paths)
    policy = policy or RetentionPolicy(max_keep=_valid_keep(max_keep))
    metrics = best_metric.metrics_of(paths, policy.best_metric) if policy.keep_best else {}
    decision = retention_plan.plan(paths, policy, protected_dirs(paths), metrics)
    spared = {absolute(p) for p in spare}
    decision.drop_optimizer[:] = [p for p in decision.drop_optimizer if absolute(p) not in spared]
    for path in decision.protected:
        log.info("retention keeps %s: latest_checkpointed_iteration.txt names it", absolute(path))
    for path in decision.best:
        log.info(
            "retention keeps %s: among the best %d by %s (%s %s)",
            absolute(path),
            policy.keep_best,
            policy.best_metric,
            policy.best_mode,
            metrics.get(path),
        )
    deleted: list[str] = []
    for path in decision.delete:
        why = delete_step_dir(path)
        if why is None:
            deleted.append(path)
            log.info("retention deleted %s", absolute(path))
        else:
            log.warning("retention kept %s: %s; it is retried at the next save", absolute(path), why)
    for path in decision.drop_optimizer:
        why = drop_step_optimizer(path, policy.optimizer_last)
        if why is not None:
            log.warning(
                "retention kept the optimizer state of %s: %s; it is retried at the next save",
                absolute(path),
                why,
            )
    return [p for p in paths if p not in deleted], deleted


def optimizer_drops(options: CheckpointOptions, saved_paths: Sequence[str], max_keep) -> list[str]:
    """Before a save: the committed steps whose optimizer state may go now. The tracker names the
    newest committed step then (the previous save's retention had to spare the step before it,
    which the tracker still named), so every step outside the newest keep_optimizer_last and the
    tracker's loses it: one fewer optimizer on disk while the new step is written. A failed save
    still leaves the tracker's step whole."""
    policy = policy_for(options, max_keep)
    paths = [p for p in saved_paths if os.path.isdir(p)]
    if policy.optimizer_last is None or not paths:
        return []
    metrics = best_metric.metrics_of(paths, policy.best_metric) if policy.keep_best else {}
    decision = retention_plan.plan(paths, policy, protected_dirs(paths), metrics)
    spared = set(decision.keep) - set(decision.drop_optimizer)
    return [p for p in paths if p not in spared]  # the ones to delete after the save lose it now too


def drop_before_save(paths: Sequence[str], keep_last: int | None) -> None:
    for path in paths:
        why = drop_step_optimizer(path, keep_last)
        if why is not None:
            log.warning(
                "retention kept the optimizer state of %s: %s; it is retried at the next save",
                absolute(path),
                why,
            )


def before_save(state: TargetState, options: CheckpointOptions, saved_paths: Sequence[str], max_keep) -> None:
    """verl deletes here; slimckpt deletes nothing until the new step is complete, and drops only
    the optimizer state retention no longer keeps (optimizer_drops)."""
    if state.retention_deferred:
        return  # the incremental tier's save runs them where it writes (step_commit.make_room)
    drops = optimizer_drops(options, saved_paths, max_keep)
    if drops:
        drop_before_save(drops, options.keep_optimizer_last)


@contextlib.contextmanager
def deferred(state: TargetState) -> Iterator[None]:
    """The caller's own save run inside the incremental tier's (verl's: for huggingface/ and
    fsdp_config.json) registers the step before its shards exist: nothing may be pruned then; the
    commit runs retention once the step is complete."""
    state.retention_deferred = True
    try:
        yield
    finally:
        state.retention_deferred = False


def after_save(
    state: TargetState, options: CheckpointOptions, saved_paths: list[str], new_path: str, max_keep
) -> list[str]:
    """Track `new_path` (complete now) in `saved_paths` (updated in place) and delete what retention
    allows; returns the deleted dirs."""
    new = absolute(new_path)
    paths = [p for p in saved_paths if absolute(p) != new] + [new_path]
    if state.retention_deferred:
        saved_paths[:] = paths
        return []
    if options.incremental_save:  # its steps carry the manifest that says slimckpt committed them
        earlier_steps.track_earlier(state, paths, new_path)  # an earlier launch's steps, at the first commit
    # the step before this one keeps its optimizer at this commit: the new step is complete for this role
    # only (a later role may still fail it, and the run then resumes the step before), and an async
    # tracker may not name the step before yet; the next save's start, when the tracker names the newest
    # complete step, drops it by the policy
    previous = paths[-2:-1]
    kept, deleted = apply(paths, max_keep, policy_for(options, max_keep), spare=previous)
    saved_paths[:] = kept
    return deleted


__all__ = [
    "after_save",
    "apply",
    "before_save",
    "delete_step_dir",
    "drop_before_save",
    "drop_step_optimizer",
    "optimizer_drops",
    "peak_steps",
    "policy_for",
    "verl_peak_steps",
    "deferred",
]
