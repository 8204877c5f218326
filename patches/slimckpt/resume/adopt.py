"""Which saved step a run resumes, whatever format it is in, and what loading it drops.

A job's checkpoints can sit in two directories: verl's `default_local_dir` and its `model_only`
subdirectory (where the model-only recipes put theirs, so that a run loading the optimizer never
picks a step without one). Adding or dropping a recipe on a relaunch moves the run from one to the
other; verl's `resume_mode=auto` only looks at its own, and would start again from step 0 without
a word. `plan_resume` looks at both and returns one decision:

  - keep:   verl's own resume is right (nothing saved, or the newest step is where verl looks);
            `message` says what loading it drops, if anything;
  - resume: the newest step is in the other directory: resume from `step_dir` (the trainer's
            resume_path), `message` saying so and what it drops;
  - stop:   this run cannot load the newest step (slimckpt's `dcp/` format without a recipe, or
            state the step does not hold); `message` is the one line naming the step and the way
            forward.

Pure: it reads directory listings, verl's tracker and slimckpt's manifests, nothing else.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slimckpt.engine.checkpoint_dir import DCP_DIR
from slimckpt.layout.dropped_optimizer import optimizer_dropped
from slimckpt.layout.names import SHARD_CONTENTS
from slimckpt.layout.resume_manifest import UncommittedCheckpoint, read_manifest
from slimckpt.resume.intact_resume import latest_intact_step

MODEL_ONLY_DIR = "model_only"  # where the model-only recipes move default_local_dir
_VERL_FILE = re.compile(r"^(model|optim|extra_state)_world_size_\d+_rank_\d+\.pt$")
_CONTENT_OF = {"model": "model", "optim": "optimizer", "extra_state": "extra"}
_WHAT = {"optimizer": "the optimizer state (Adam moments, step count)", "extra": "the lr scheduler and RNG state"}


@dataclass(frozen=True)
class RoleState:
    """What one role dir of a step holds: `fmt` "slimckpt" (a `dcp/` resume state) or "verl" (its
    rank files); `contents` among model/optimizer/extra."""

    fmt: str
    contents: tuple[str, ...]

    def describe(self) -> str:
        kind = "slimckpt's dcp/ format" if self.fmt == "slimckpt" else "verl's rank files"
        return f"{kind}: {'+'.join(self.contents) or 'nothing'}"


@dataclass(frozen=True)
class RoleLoad:
    """How the run loads one role: its checkpoint.load_contents, and whether its checkpoint config is
    slimckpt's (only then can the worker read a `dcp/` step)."""

    name: str
    load_contents: tuple[str, ...]
    slim: bool


@dataclass(frozen=True)
class Decision:
    action: str  # "keep" | "resume" | "stop"
    step_dir: str | None = None
    message: str = ""


def role_state(role_dir: str) -> RoleState | None:
    """The format and contents of a saved role dir; None when it holds no state (absent, deleted)."""
    if os.path.isdir(os.path.join(role_dir, DCP_DIR)):
        try:
            manifest = read_manifest(role_dir)
        except UncommittedCheckpoint:  # the worker's loader refuses it with the one line of `slimckpt verify`
            return RoleState("slimckpt", SHARD_CONTENTS)
        return RoleState("slimckpt", tuple(c for c in SHARD_CONTENTS if c in manifest.contents))
    try:
        names = os.listdir(role_dir)
    except OSError:
        return None
    contents = {_CONTENT_OF[m.group(1)] for m in map(_VERL_FILE.match, names) if m}
    if "model" not in contents:
        return None
    return RoleState("verl", tuple(c for c in SHARD_CONTENTS if c in contents))


def latest_step(root: str, roles: Sequence[str] = ("actor",)) -> int | None:
    """The step resume_mode=auto resumes in `root`: intact_resume.latest_intact_step over the role
    dirs the run loads (the tracker's step, or the newest intact one below it when it is damaged
    or missing, as the trainer's resume then does). Sizes and seals only: the trainer's own check
    reads the checksums before its load."""
    return latest_intact_step(root, {r: False for r in roles})


def sibling_dir(root: str) -> str:
    """The job's other checkpoint directory: `model_only` below verl's, or verl's above `model_only`."""
    root = os.path.normpath(root)
    if os.path.basename(root) == MODEL_ONLY_DIR:
        return os.path.dirname(root)
    return os.path.join(root, MODEL_ONLY_DIR)


def convert_command(step_dir: str, world_size: int | None) -> str:
    """The command that writes a step as verl's own rank files (slimckpt.convert)."""
    ranks = str(world_size) if world_size else "<this run's GPUs>"
    return f"slimckpt convert {step_dir} --to verl --world-size {ranks}"


def _check_role(step_dir: str, role: RoleLoad, world_size: int | None = None) -> tuple[str | None, list[str]]:
    """(why this run cannot load the role, or None; what loading it drops)."""
    where = os.path.join(step_dir, role.name)
    state = role_state(where)
    if state is None:
        return (
            f"slimckpt: {where} holds no saved {role.name} state, which this run loads: resume an earlier step "
            f"with trainer.resume_mode=resume_path trainer.resume_from_path=<its global_step_N dir>, or start "
            f"afresh with trainer.resume_mode=disable"
        ), []
    if state.fmt == "slimckpt" and not role.slim:
        return (
            f"slimckpt: {where} is in slimckpt's incremental format (dcp/), which verl's own loader cannot "
            f"read: relaunch with +recipe=incremental to continue from it (exactly), or +recipe=quickstart "
            f"(its weights; the optimizer restarts), or write it as verl's own files with "
            f"`{convert_command(os.path.dirname(where), world_size)}` and resume from the directory it names"
        ), []
    missing = [c for c in role.load_contents if c in SHARD_CONTENTS and c not in state.contents]
    # retention's keep_optimizer_last: the load resumes the rest and says so (format.dropped_optimizer)
    by_retention = "optimizer" in missing and optimizer_dropped(where) is not None
    if by_retention:
        missing.remove("optimizer")
    if missing:
        settings = " ".join(
            f"{key}.checkpoint.load_contents=[{','.join(state.contents)}]"
            for key in ("actor_rollout_ref.actor", "critic")
        )
        return (
            f"slimckpt: {where} holds {'+'.join(state.contents)} only ({state.describe()}), and this run "
            f"also loads {'+'.join(missing)}: relaunch with +recipe=quickstart to continue from its weights "
            f"(the optimizer restarts), or add {settings}"
        ), []
    dropped = [c for c in state.contents if c not in role.load_contents]
    return None, dropped + (["optimizer"] if by_retention else [])


def _dropped_line(dropped: Mapping[str, list[str]], recipe: str | None) -> str:
    parts = [f"{role} {'+'.join(what)}" for role, what in dropped.items() if what]
    if not parts:
        return ""
    kinds = [c for c in SHARD_CONTENTS if any(c in what for what in dropped.values())]
    restart = " and ".join(_WHAT[c] for c in kinds if c in _WHAT)
    by = f"+recipe={recipe}" if recipe else "checkpoint.load_contents"
    return f"; {by} does not load {', '.join(parts)}: {restart} start afresh"


def plan_resume(
    local_dir: str,
    resume_mode: str,
    roles: Sequence[RoleLoad],
    recipe: str | None = None,
    resume_from_path: str | None = None,
    world_size: int | None = None,
) -> Decision:
    """The decision for a run whose trainer.default_local_dir is `local_dir` (absolute), loading
    `roles` ("actor", and "critic" where the run has one); `recipe` is the recipe's name, None
    without one; `world_size` the run's ranks (named in the convert command a refusal gives)."""
    if resume_mode == "disable":
        return Decision("keep")
    if resume_mode == "resume_path":
        if not resume_from_path:
            return Decision("keep")  # verl's own assertion names the missing key
        return _judge(os.path.normpath(resume_from_path), roles, recipe, moved=False, world_size=world_size)
    here, there = os.path.normpath(local_dir), sibling_dir(local_dir)
    names = [r.name for r in roles] or ["actor"]
    mine, other = latest_step(here, names), latest_step(there, names)
    if other is None or (mine is not None and mine >= other):
        if mine is None:
            return Decision("keep")
        return _judge(os.path.join(here, f"global_step_{mine}"), roles, recipe, moved=False, world_size=world_size)
    return _judge(
        os.path.join(there, f"global_step_{other}"),
        roles,
        recipe,
        moved=True,
        saves_to=here,
        mine=mine,
        world_size=world_size,
    )


def _judge(
    step_dir: str,
    roles: Sequence[RoleLoad],
    recipe: str | None,
    moved: bool,
    saves_to: str = "",
    mine: int | None = None,
    world_size: int | None = None,
) -> Decision:
    dropped: dict[str, list[str]] = {}
    for role in roles:
        why, drops = _check_role(step_dir, role, world_size)
        if why:
            return Decision("stop", step_dir, why)
        dropped[role.name] = drops
    tail = _dropped_line(dropped, recipe)
    if not moved:
        return Decision("keep", step_dir, f"slimckpt: resuming from {step_dir}{tail}" if tail else "")
    if recipe is None:
        # verl's own trainer would resume an older step (or none) without a word: a silent step back
        if mine is None:
            back, older = "start from step 0", "trainer.resume_mode=disable"
        else:
            back = f"go back to global_step_{mine}"
            older = (
                f"trainer.resume_mode=resume_path "
                f"trainer.resume_from_path={os.path.join(saves_to, f'global_step_{mine}')}"
            )
        return Decision(
            "stop",
            step_dir,
            f"slimckpt: the newest step of this job is {step_dir}, outside "
            f"trainer.default_local_dir {saves_to}, where verl would {back}: relaunch "
            f"with +recipe=quickstart to continue from it, or pass {older} to go back",
        )
    already = f" (newer than its global_step_{mine})" if mine is not None else ""
    return Decision(
        "resume",
        step_dir,
        f"slimckpt: +recipe={recipe} continues from {step_dir}, the newest step of "
        f"this job{already}; new steps go to {saves_to}{tail}",
    )
