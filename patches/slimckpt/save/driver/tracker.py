"""Driver side of async incremental saves: verl's tracker only ever names a committed step.

verl's trainers (v1 `PPOTrainer._save_checkpoint` and the legacy `RayPPOTrainer`) skip writing
`latest_checkpointed_iteration.txt` when the actor's `checkpoint.async_save` is true, and nothing
else writes it (verl #7952): resume_mode=auto then restarts from step 0. With slimckpt's async
incremental saves the workers' save calls return once the state is staged, before it is on disk.

Choice: one writer of the tracker, in the trainer's process. After verl's `_save_checkpoint`
returns (actor, critic and data.pt handed off), a watcher thread waits until every incremental
role dir of that step holds its manifest, then writes the tracker atomically (never backwards).
Why not the workers: no worker knows whether a critic exists or when the driver has written
data.pt, and two writers could race. Why not block the trainer until the commit: that is the
sync mode. Each worker's next save first waits for its previous write, so when the next
`_save_checkpoint` returns the previous step is committed and its watcher ends at once. At the
last training step the trainer waits for the commit before returning (the trainer's process is a
Ray actor that is torn down right after fit(), so an atexit hook there is not reliable). A
background write that fails leaves a marker file; the watcher stops and the failure is raised.

Retention cannot delete the step the tracker names (resume_manifest.protected_dirs), so during
the window between a commit and the tracker write both steps exist. The watcher checks a step and
writes the tracker under a shared lock on the step's role dirs, and retention deletes under the
exclusive one after reading the tracker again, so neither acts on what the other is changing.
"""

from __future__ import annotations

# lazy imports: torch-free for the driver's resume check (intact_resume, adopt); the save's error
# handling (torch.distributed) loads only in the trainer's save
import contextlib
import functools
import glob
import hashlib
import os
import threading
import time

from slimckpt.engine.resume_records import write_tracker
from slimckpt.layout.resume_manifest import (
    MANIFEST_NAME,
    failure_markers,
    has_manifest,
    read_tracker,
    saved_steps,
)
from slimckpt.log import get_logger
from slimckpt.options.checkpoint_options import CheckpointOptions, role_options
from slimckpt.save.driver.driver_state import driver_state_of
from slimckpt.save.errors import save_then_restore_tracker
from slimckpt.storage import for_path, is_file, is_url
from slimckpt.storage.locks import LockBusy, reading

log = get_logger("slimckpt.tracker")

# the recipes' _target_, and the path configs written before the package was split still name
POLL_S = 0.2


def is_incremental(options: CheckpointOptions | None) -> bool:
    return options is not None and options.incremental_save


def is_async_incremental(options: CheckpointOptions | None) -> bool:
    return is_incremental(options) and options.async_save != "off"


def watched_roles(trainer) -> list[str] | None:
    """Role dirs whose manifest must exist before the tracker moves, or None when verl writes the
    tracker itself (the actor is not async)."""
    actor = role_options(trainer.config, "actor")
    critic = role_options(trainer.config, "critic") if getattr(trainer, "use_critic", False) else None
    if not is_async_incremental(actor):
        if is_async_incremental(critic):
            raise ValueError(
                "slimckpt: critic.checkpoint.async_save=true needs actor_rollout_ref.actor.checkpoint.async_save=true "
                "too (verl writes the tracker as soon as the saves return unless the actor's async_save is set)"
            )
        return None
    roles = ["actor"]  # the role dirs verl's trainer saves into: "actor", and str(Role.Critic)
    if critic is not None and is_incremental(critic):
        roles.append("critic")
    return roles


class CommitWatcher:
    """Writes the tracker for a step once all its role dirs are committed."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self.error: str | None = None
        self.keep_going = False  # on_save_error=continue: a failed step is logged, not raised
        self.superseded: str | None = None
        # commits already on disk when this run began saving: steps above the one a resume went on
        # from (a damaged newest step it walked back from) are no commit of this run's
        self._before = {path: self._commit_id(path) for path in self._manifests(root)}

    @staticmethod
    def _manifests(root: str) -> list[str]:
        if not is_url(root):
            return glob.glob(os.path.join(glob.escape(root), "global_step_*", "*", MANIFEST_NAME))
        store = for_path(root)
        step_dirs = [os.path.join(root, f"global_step_{s}") for s in saved_steps(root)]
        return [
            os.path.join(d, role, MANIFEST_NAME)
            for d in step_dirs
            for role in store.list_dir(d)
            if is_file(os.path.join(d, role, MANIFEST_NAME))
        ]

    @staticmethod
    def _commit_id(manifest: str) -> tuple[int, int] | str | None:
        if is_url(manifest):  # an object store: each commit's manifest differs (its committed_at)
            try:
                with for_path(manifest).open_read(manifest) as f:
                    return hashlib.sha256(f.read()).hexdigest()
            except OSError:
                return None
        try:
            st = os.stat(manifest)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns  # a commit renames a new file into place: a new inode

    def _newer_commit(self, step: int, role: str) -> int | None:
        """The newest step after `step` whose `role` dir this run committed, if any."""
        for s in reversed(saved_steps(self.root)):
            manifest = os.path.join(self.root, f"global_step_{s}", role, MANIFEST_NAME)
            if s > step and (found := self._commit_id(manifest)) is not None and self._before.get(manifest) != found:
                return s
        return None

    def _superseded(self, step: int, roles: list[str]) -> str | None:
        """Why this step is no longer there to be named, when retention got here first.

        Async at max_ckpt_to_keep=1: the next step's commit can delete this one before this thread
        looks (the poll misses the moment between this step's manifest and the next commit).
        Retention removes role dirs (verl tracks those), not the step dir: data.pt stays. A role
        dir without its manifest while a newer step of that role is committed can only be such a
        leftover: each save first waits for the previous one's write, so this step's write had
        ended by then.
        Such a step is never named; the newer step's watcher moves the tracker. Only this run's
        commits count: a newer step left from before a resume that walked back from it (damaged)
        deletes nothing."""
        step_dir = os.path.join(self.root, f"global_step_{step}")
        if not for_path(step_dir).is_dir(step_dir):
            return f"{step_dir} was deleted"
        for role in roles:
            if not has_manifest(os.path.join(step_dir, role)):
                newer = self._newer_commit(step, role)
                if newer is not None:
                    return f"its {role} dir was deleted by retention once step {newer} committed"
        return None

    def _committed(self, step: int, roles: list[str]) -> bool:
        step_dir = os.path.join(self.root, f"global_step_{step}")
        for role in roles:
            role_dir = os.path.join(step_dir, role)
            failed = failure_markers(role_dir)
            if failed:
                self.error = (
                    f"slimckpt: the save of step {step} failed (see {failed[0]}); the tracker stays at "
                    f"{read_tracker(self.root)}"
                )
                return True
        self.superseded = self._superseded(step, roles)
        if self.superseded is not None:
            return True
        if not all(has_manifest(os.path.join(step_dir, role)) for role in roles):
            return False
        return for_path(step_dir).exists(os.path.join(step_dir, "data.pt"))

    def _name(self, step: int, roles: list[str]) -> bool | None:
        """Write the tracker for `step` holding a shared lock on each of its role dirs; None when
        retention holds one of them now (the caller polls again).

        Retention deletes a role dir under its exclusive lock and reads the tracker again under it.
        Without these locks, a step found whole here could lose a role dir to the next step's
        commit (async, max_ckpt_to_keep=1, which read the tracker while it still named the step
        before) between that check and the write: the tracker would then name a deleted step."""
        step_dir = os.path.join(self.root, f"global_step_{step}")
        with contextlib.ExitStack() as held:
            try:
                for role in roles:
                    held.enter_context(reading(os.path.join(step_dir, role), "naming it in the tracker"))
            except LockBusy:
                return None
            # True also for a failed or a superseded step: both are set on self, and neither is named
            if not self._committed(step, roles) or self.error or self.superseded is not None:
                return False
            return write_tracker(self.root, step)

    def _watch(self, step: int, roles: list[str]) -> None:
        self.superseded = None
        written: bool | None = None
        while written is None:
            while not self._committed(step, roles):
                time.sleep(POLL_S)
            if self.error or self.superseded is not None:
                break
            written = self._name(step, roles)
            if written is None:
                time.sleep(POLL_S)
        if self.error:
            log.error("%s", self.error)
        elif self.superseded is not None:
            log.info("step %s is not named: %s; the tracker moves with a newer step", step, self.superseded)
        elif written:
            log.info("tracker -> step %s (committed)", step)

    def after_save(self, step: int, roles: list[str]) -> None:
        self.wait(timeout=120.0)  # the previous step: committed before this save's calls returned
        self._step = step
        self._thread = threading.Thread(target=self._watch, args=(step, roles), name="slimckpt-tracker", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        thread = self._thread
        if thread is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while thread.is_alive():
            thread.join(30.0 if deadline is None else max(0.0, min(30.0, deadline - time.monotonic())))
            if thread.is_alive():
                if deadline is not None and time.monotonic() >= deadline:
                    raise RuntimeError(f"slimckpt: step {self._step} was not committed within {timeout:.0f} s")
                log.info("waiting for step %s to be committed before moving the tracker", self._step)
        self._thread = None
        if self.error and self.keep_going:
            self.error = None  # logged by _watch; the tracker stays on the last committed step
        if self.error:
            error, self.error = self.error, None
            raise RuntimeError(error)


def wrap_trainer_save_checkpoint(original):
    @functools.wraps(original)
    def _save_checkpoint(self, *args, **kwargs):
        roles = watched_roles(self)
        if roles is None:  # verl writes the tracker; put it back if a save failed (on_save_error=continue)
            return save_then_restore_tracker(self, original, *args, **kwargs)
        result = original(self, *args, **kwargs)  # verl skips its tracker write: actor async_save=true
        state = driver_state_of(self)
        watcher = state.watcher
        if watcher is None:
            watcher = state.watcher = CommitWatcher(self.config.trainer.default_local_dir)
            actor = role_options(self.config, "actor")
            watcher.keep_going = actor is not None and actor.on_save_error == "continue"
        watcher.after_save(int(self.global_steps), roles)
        if int(self.global_steps) >= int(getattr(self, "total_training_steps", 0) or 0):
            watcher.wait()  # last step: the run ends after this, so finish the commit now
        return result

    return _save_checkpoint
