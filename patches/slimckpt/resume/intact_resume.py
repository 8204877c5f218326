"""Which step a resume loads: resume_mode=auto goes on from the newest intact step.

verl's trainer reads `latest_checkpointed_iteration.txt` and loads the step it names; if that
step rotted on disk since its commit (a flipped bit, a truncated copy, a lost file), the load
refuses it and the restart dies, though an earlier step is whole. Here, before verl's
`_load_checkpoint` runs, the step it is about to load is checked with the load's own definition
of intact (resume_manifest.role_damage, which `slimckpt verify` prints): every role dir the
trainer loads (actor, and the critic when there is one) and data.pt. If it is damaged, one line
says which file and why, the tracker is moved (atomically) to the newest intact step below it,
and verl's own code then loads that one. Nothing is deleted: the damaged step stays as it is,
for `slimckpt verify` or a re-copy, and a later save of the same step replaces it as usual.
Moving the tracker keeps it what verl's is: the step the run goes on from; the next commit moves
it forward again. With no intact step left, the resume refuses in one line instead of silently
training from scratch. An empty tracker (a kill during verl's write) is repaired the same way.
`trainer.resume_from_path` naming a damaged step refuses in one line naming the file and an
intact step to use instead. On object storage (`s3://`) the lookup itself takes only committed
steps (trainer_storage.latest_committed_step) and each rank's load checks its files: nothing here.

What it costs the driver: sizes and the manifests' seals of every role (no file is read, a few
ms) and the CRC32 of data.pt's zip records. The checksums of the role dirs are the load's own: every
rank checks its share of the listed files (slimckpt.resume.step_check, agreed through the collective
helper) before any of it is read, so the check's time does not grow with the cluster on one host. A
step whose checksums the ranks refuse (a flipped bit: same size, same seal) is handled here too: the
tracker moves to the newest step below it whose sizes check out, and verl's load runs again (its
ranks check that one). With `verify: false` the ranks check sizes only. verl's own format records
no checksums: for such role dirs the check is whether verl's save finished (fsdp_config.json, no
failure marker) and data.pt. Only a refused `trainer.resume_from_path` checksums a step on the
driver: the older one its message names as intact.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

from slimckpt.engine.checkpoint_dir import DCP_DIR
from slimckpt.engine.resume_records import atomic_write_text
from slimckpt.layout.dropped_optimizer import optimizer_dropped
from slimckpt.layout.resume_manifest import (
    DAMAGED_FIX,
    TRACKER_NAME,
    Damage,
    UncommittedCheckpoint,
    has_manifest,
    read_tracker,
    role_damage,
    saved_steps,
)
from slimckpt.log import get_logger
from slimckpt.options.checkpoint_options import role_options
from slimckpt.resume.tracker_recovery import role_complete
from slimckpt.storage import is_url
from slimckpt.verify.native import check_zip_records

log = get_logger("slimckpt.resume")

DATA_FILE = "data.pt"


@dataclass
class StepCheck:
    step: int
    damage: Damage | None  # the first problem found; None: intact
    bytes: int  # bytes the checksums read
    seconds: float


def _damage(path: str, reason: str) -> Damage:
    return Damage(-1, path, reason, f"slimckpt: {path}: {reason}; {DAMAGED_FIX}")


def _role(role_dir: str, checksums: bool) -> tuple[Damage | None, int]:
    """First problem of one role dir the trainer loads, and the bytes its manifest lists."""
    if not os.path.isdir(role_dir):
        return _damage(role_dir, "missing, but the trainer loads it"), 0
    if has_manifest(role_dir) or os.path.isdir(os.path.join(role_dir, DCP_DIR)):
        manifest, damage = role_damage(role_dir, checksums=checksums)
        return (damage[0] if damage else None), sum(e.size for e in manifest.files) if manifest else 0
    # verl's own format records no checksums: all there is to check is that its save finished
    if not role_complete(role_dir):
        return _damage(
            role_dir, "verl's save of this role did not finish (no fsdp_config.json, or a failure marker)"
        ), 0
    return None, 0


def _data(step_dir: str, checksums: bool) -> Damage | None:
    path = os.path.join(step_dir, DATA_FILE)
    if not os.path.isfile(path):
        return _damage(path, "missing (it holds the dataloader's position)")
    if not checksums:
        return None
    # torch's CRC32 of every zip record (what `slimckpt verify` checks first): whole and unaltered,
    # without unpickling it here; verl's own torch.load reads it next
    reason = check_zip_records(path)
    return _damage(path, reason) if reason else None


def check_step(root: str, step: int, roles: dict[str, bool]) -> StepCheck:
    """Is `<root>/global_step_<step>` intact for a load of `roles` ({role dir: checksums})?
    Sizes and seals of every role first, so a short or lost file shows before any data is read."""
    start = time.perf_counter()
    step_dir = os.path.join(root, f"global_step_{step}")
    total = 0
    for checksums_pass in (False, True):
        for role, checksums in roles.items():
            if checksums_pass and not checksums:
                continue
            damage, nbytes = _role(os.path.join(step_dir, role), checksums_pass)
            if damage is None and checksums_pass:
                total += nbytes
            if damage is not None:
                return StepCheck(step, damage, total, time.perf_counter() - start)
        damage = _data(step_dir, checksums_pass)
        if damage is not None:
            return StepCheck(step, damage, total, time.perf_counter() - start)
    return StepCheck(step, None, total, time.perf_counter() - start)


def newest_intact(root: str, roles: dict[str, bool], at_most: int | None) -> tuple[StepCheck | None, list[StepCheck]]:
    """(the newest intact step <= at_most, or None; the damaged ones above it, newest first)."""
    damaged: list[StepCheck] = []
    for step in reversed(saved_steps(root)):
        if at_most is not None and step > at_most:
            continue
        check = check_step(root, step, roles)
        if check.damage is None:
            return check, damaged
        damaged.append(check)
    return None, damaged


def latest_intact_step(root: str, roles: dict[str, bool]) -> int | None:
    """The step resume_mode=auto resumes in `root`: the tracker's when it is intact, else the newest
    intact one below it (an empty tracker: the newest intact step); None without a tracker (verl
    starts from scratch) or without an intact step. The one definition of "latest intact step":
    the trainer's patch below moves the tracker to it, slimckpt.resume.adopt compares the job's two
    directories by it. A step whose optimizer retention dropped is intact (it resumes model-only:
    every older step lost it too, so walking further back would only lose more training)."""
    if not os.path.exists(os.path.join(root, TRACKER_NAME)):
        return None
    good, _ = newest_intact(root, roles, read_tracker(root))
    return good.step if good is not None else None


# --------------------------------------------------------------------------- the trainer patch


def loaded_roles(trainer) -> dict[str, bool] | None:
    """{role dir: checksums} that verl's _load_checkpoint loads, or None when the actor's
    checkpoint config is not a slimckpt recipe's (plain verl: left as verl does it)."""
    actor = role_options(trainer.config, "actor")
    if actor is None:
        return None
    roles = {"actor": actor.verify}
    if getattr(trainer, "use_critic", False):
        critic = role_options(trainer.config, "critic")
        roles["critic"] = critic.verify if critic is not None else True
    return roles


def _absolute(path: str) -> str:
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)  # as verl resolves it


def _said(check: StepCheck) -> str:
    how = f"{check.bytes / 2**20:.0f} MiB checksummed" if check.bytes else "sizes only"
    return f"global_step_{check.step} ({how}, {check.seconds:.1f} s)"


def _auto(root: str, roles: dict[str, bool]) -> None:
    """Point the tracker at the newest intact step before verl reads it (see the module doc)."""
    tracker = os.path.join(root, TRACKER_NAME)
    if not os.path.exists(tracker):
        return  # verl: training from scratch
    named = read_tracker(root)
    good, damaged = newest_intact(root, roles, named)
    if named is not None and not os.path.isdir(os.path.join(root, f"global_step_{named}")):
        gone = _damage(os.path.join(root, f"global_step_{named}"), f"missing, but {TRACKER_NAME} names it")
        damaged.insert(0, StepCheck(named, gone, 0, 0.0))
    if good is not None and good.step == named:
        log.info("resume: %s is intact", _said(good))
        return
    if good is None:
        if named is None or not saved_steps(root):
            return  # an empty tracker and no intact step, or no step at all: verl's (and tracker_recovery's) call
        first = damaged[0].damage
        raise UncommittedCheckpoint(
            f"slimckpt: {first.file}: {first.reason}; no step in {root} at or below global_step_{named} is intact "
            f"(checked {', '.join(f'global_step_{c.step}' for c in damaged)}): re-copy the damaged files, or "
            f"start from scratch with trainer.resume_mode=disable"
        )
    atomic_write_text(tracker, str(good.step))
    if named is None:
        log.warning(
            "slimckpt: %s was empty or unreadable (a kill during verl's tracker write): it now names "
            "global_step_%d, the newest intact step",
            tracker,
            good.step,
        )
        return
    first = damaged[0].damage
    also = [c.step for c in damaged[1:]]
    model_only = [r for r in roles if optimizer_dropped(os.path.join(root, f"global_step_{good.step}", r))]
    log.warning(
        "slimckpt: %s: %s; resuming from global_step_%d, the newest intact step (%s now names it; "
        "global_step_%d is left on disk as it is%s)%s",
        first.file,
        first.reason,
        good.step,
        TRACKER_NAME,
        damaged[0].step,
        f"; also damaged: {', '.join(f'global_step_{s}' for s in also)}" if also else "",
        f"; retention dropped its {'/'.join(model_only)} optimizer state: the optimizer starts afresh"
        if model_only
        else "",
    )


def _resume_path(path: str, roles: dict[str, bool]) -> None:
    """Refuse a resume_from_path whose step is damaged by its sizes and seals, naming the file and
    an intact step (checksummed: the run stops anyway)."""
    where = _step_dir(path)
    if where is None:
        return  # verl's own assertion says what it must look like
    root, step = where
    check = check_step(root, step, _sizes(roles))  # the ranks' load checksums it
    if check.damage is None:
        log.info("resume: %s is intact", _said(check))
        return
    raise _damaged_resume_path(f"slimckpt: {check.damage.file}: {check.damage.reason}", root, step, roles)


def _step_dir(path: str) -> tuple[str, int] | None:
    """(root, N) of a resume_from_path `<root>/global_step_N`; None for anything else."""
    step_dir = os.path.normpath(_absolute(path))
    name = os.path.basename(step_dir)
    if not name.startswith("global_step_") or not name[len("global_step_") :].isdigit():
        return None
    return os.path.dirname(step_dir), int(name[len("global_step_") :])


def _damaged_resume_path(line: str, root: str, step: int, roles: dict[str, bool]) -> UncommittedCheckpoint:
    """The one-line refusal of a damaged resume_from_path, naming an intact step below it (checksummed
    here: the run stops anyway)."""
    good, _ = newest_intact(root, roles, step - 1)
    instead = (
        f"trainer.resume_from_path={os.path.join(root, f'global_step_{good.step}')} (intact)"
        if good
        else "an earlier step (none below it in this dir is intact)"
    )
    return UncommittedCheckpoint(
        f"{line}; trainer.resume_from_path names a damaged step: re-copy the file, or resume from {instead}"
    )


def load_refusal(exc: BaseException) -> str | None:
    """The one line of a load that a rank refused as damaged (UncommittedCheckpoint, also when it
    comes back wrapped by Ray or chained), without its generic fix; None for any other failure."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        cause = getattr(e, "cause", None)  # Ray's RayTaskError carries the worker's exception here
        if isinstance(cause, BaseException):
            todo.insert(0, cause)
            continue
        if isinstance(e, UncommittedCheckpoint):
            line = (str(e).strip().splitlines() or [""])[0]
            return line.removesuffix(f"; {DAMAGED_FIX}")
        todo += [e.__cause__, e.__context__]
    return None


def _sizes(roles: dict[str, bool]) -> dict[str, bool]:
    return dict.fromkeys(roles, False)


def _load_walking_back(original, trainer, args, kwargs, root: str, roles: dict[str, bool]):
    """verl's load; where its ranks refuse the tracker's step as damaged, the tracker moves to the
    newest older step whose sizes check out and verl loads again (its ranks checksum that one)."""
    tracker = os.path.join(root, TRACKER_NAME)
    refused: list[int] = []  # steps the ranks refused on this walk, newest first
    while True:
        named = read_tracker(root)  # the step verl loads now: read before, another reader may move it after
        try:
            return original(trainer, *args, **kwargs)
        except Exception as exc:
            line = load_refusal(exc)
            if line is None or named is None:
                raise
            refused.append(named)
            good, damaged = newest_intact(root, _sizes(roles), named - 1)
            if good is None:
                checked = refused + [c.step for c in damaged]
                raise UncommittedCheckpoint(
                    f"{line}; no step in {root} at or below global_step_{refused[0]} is intact (checked "
                    f"{', '.join(f'global_step_{s}' for s in checked)}): re-copy the damaged files, or start "
                    f"from scratch with trainer.resume_mode=disable"
                ) from exc
            atomic_write_text(tracker, str(good.step))
            also = [c.step for c in damaged]
            model_only = [r for r in roles if optimizer_dropped(os.path.join(root, f"global_step_{good.step}", r))]
            log.warning(
                "%s; resuming from global_step_%d, the newest intact step (%s now names it; global_step_%d is "
                "left on disk as it is%s)%s",
                line,
                good.step,
                TRACKER_NAME,
                named,
                f"; also damaged: {', '.join(f'global_step_{s}' for s in also)}" if also else "",
                f"; retention dropped its {'/'.join(model_only)} optimizer state: the optimizer starts afresh"
                if model_only
                else "",
            )


def _load_resume_path(original, trainer, args, kwargs, path: str, roles: dict[str, bool]):
    """verl's load of resume_from_path; a step its ranks refuse is refused in one line naming an
    intact step below it (checksummed here: the run stops anyway)."""
    try:
        return original(trainer, *args, **kwargs)
    except Exception as exc:
        line, where = load_refusal(exc), _step_dir(path)
        if line is None or where is None:
            raise
        raise _damaged_resume_path(line, *where, roles) from exc


def wrap_trainer_load_checkpoint(original):
    @functools.wraps(original)
    def _load_checkpoint(self, *args, **kwargs):
        roles = loaded_roles(self)
        trainer = self.config.trainer
        mode = trainer.resume_mode
        on_storage = is_url(str(trainer.default_local_dir or "")) or (
            mode == "resume_path" and is_url(str(trainer.resume_from_path or ""))
        )
        if on_storage:
            # object storage: the lookup takes committed steps only (trainer_storage), each rank checks its load
            return original(self, *args, **kwargs)
        if roles is not None and mode == "auto" and trainer.default_local_dir:
            root = _absolute(str(trainer.default_local_dir))
            _auto(root, _sizes(roles))  # no file read here: the ranks' load checksums what it reads
            return _load_walking_back(original, self, args, kwargs, root, roles)
        if roles is not None and mode == "resume_path" and isinstance(trainer.resume_from_path, str):
            _resume_path(trainer.resume_from_path, roles)
            return _load_resume_path(original, self, args, kwargs, trainer.resume_from_path, roles)
        return original(self, *args, **kwargs)

    return _load_checkpoint
