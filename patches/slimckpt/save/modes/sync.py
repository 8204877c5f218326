"""async_save=false: nothing staged; the save writes the shards from the live state and returns
once the step is committed."""

from __future__ import annotations

from typing import Any

from slimckpt.save import step_write
from slimckpt.save.modes.base import AsyncMode, Staged
from slimckpt.save.modes.writer import AsyncResumeWriter
from slimckpt.save.save_context import SaveContext


class SyncMode(AsyncMode):
    name = "off"
    background = False

    def stage(self, ctx: SaveContext, state: dict[str, Any], writer: AsyncResumeWriter) -> Staged:
        return Staged(ctx, state)

    def finish(self, staged: Staged, writer: AsyncResumeWriter) -> None:
        step_write.write_and_commit(staged.ctx, staged.state)


__all__ = ["SyncMode"]
