"""async_save=true (pool): the rank's tensors copied into the host staging pool, written from there
on the writer's thread (resume_async). The training step waits only for the copy (on CUDA, the
training stream waits for the copies' event, queued by the stage itself). When the largest rank's
state is over host_memory_budget_gb, every rank saves as sync does (the writer's stage decides it
over the group and logs it)."""

from __future__ import annotations

import functools
from typing import Any

from slimckpt.save import step_write
from slimckpt.save.modes.base import AsyncMode, Staged
from slimckpt.save.modes.sync import SyncMode
from slimckpt.save.modes.writer import AsyncResumeWriter
from slimckpt.save.save_context import SaveContext


class PoolMode(AsyncMode):
    name = "pool"

    def stage(self, ctx: SaveContext, state: dict[str, Any], writer: AsyncResumeWriter) -> Staged:
        staged = writer.stage(state, ctx.config, step=ctx.step, group=ctx.group)
        if staged is None:  # over the budget: written now, from the live state
            return SyncMode().stage(ctx, state, writer)
        return Staged(ctx, staged, phase="stage")

    def finish(self, staged: Staged, writer: AsyncResumeWriter) -> None:
        if staged.phase is None:
            SyncMode().finish(staged, writer)
            return
        writer.submit(
            staged.ctx.step,
            staged.ctx.local_path,
            functools.partial(step_write.write_and_commit, staged.ctx, staged.state),
            self.name,
            arm=functools.partial(self.wait_until_safe_to_step, staged),
        )


__all__ = ["PoolMode"]
