"""The protocol every async_save mode implements, and what its calls hand each other.

A save calls a mode three times (resume_save, in this order):

1. `stage(ctx, state, writer)`, in the foreground, once the sharded state dict is built: take what
   the write will read and return it as a `Staged`. Its `phase` names the timings key the
   foreground spent taking it ("stage", "capture"), or is None when nothing was taken and the
   write runs now; the caller then drops its own reference to the live state dict.
2. `wait_until_safe_to_step(staged)`, called by the writer as it takes the write, before the write
   starts: arm what keeps the next change to the shards (the optimizer step, a LoRA merge) from
   reaching what the write still reads. Returns the `Guard` the writer keeps until the write ends.
3. `finish(staged, writer)`: hand the write to the writer's thread (it then arms 2), or run it now.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from slimckpt.save.modes.writer import AsyncResumeWriter
from slimckpt.save.save_context import SaveContext


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Guard:
    """What a mode armed before the next change to the shards its write reads."""

    remove_hooks: Callable[[], None] = _nothing
    """On the training thread, at the writer's next wait or save: remove the hooks it installed
    (never from the writer's thread, which could change a hook table while training iterates it)."""
    write_ended: Callable[[], None] = _nothing
    """On the writer's thread, once the write has ended (committed or failed): nothing waits for it
    any more."""


NO_GUARD = Guard()


@dataclass(frozen=True)
class Staged:
    """What one save's write reads, as its mode took it in the foreground."""

    ctx: SaveContext
    """The save as the write sees it (stream: with its capture)."""
    state: dict[str, Any]
    """The state dict the write reads: the live one, a staged copy, a capture's."""
    phase: str | None = None
    """The timings key of what the foreground spent taking it; None: nothing taken, the write runs now."""
    capture: Any = None
    """async_save=stream: the StreamCapture the write reads through (the writer keeps it for reports)."""


class AsyncMode(ABC):
    """One way a save's write runs: now, or on the writer's thread from what `stage` took."""

    name: ClassVar[str]
    """The mode's name as a checked config holds it (checkpoint.async_save)."""
    background: ClassVar[bool] = True
    """Whether a save's write may still run when the save returns (the next save, or the writer
    lock's collective, waits for it first)."""

    @abstractmethod
    def stage(self, ctx: SaveContext, state: dict[str, Any], writer: AsyncResumeWriter) -> Staged:
        """Take what the write will read from the live `state` (collective over ctx.group where
        the ranks must agree on it)."""

    def wait_until_safe_to_step(self, staged: Staged) -> Guard:
        """Arm what the next change to the shards waits on while the write reads them. Default:
        nothing (the write reads a copy of its own, or has ended before training goes on)."""
        return NO_GUARD

    @abstractmethod
    def finish(self, staged: Staged, writer: AsyncResumeWriter) -> None:
        """Hand the write to `writer`'s thread, or run it now (returns once it is committed)."""


__all__ = ["NO_GUARD", "AsyncMode", "Guard", "Staged"]
