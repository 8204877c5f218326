"""async_save=stream: no copy; the writer reads the live shards through a StreamCapture
(stream_capture), and until it has read them every change to them first runs the capture's guard
(stream_guards: the optimizer step's pre-hook, armed here; verl's LoRA merge, offload and reload
through their patches)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from slimckpt.save import host_budget, step_write
from slimckpt.save.modes import stream_guards
from slimckpt.save.modes.base import AsyncMode, Guard, Staged
from slimckpt.save.modes.stream_capture import StreamCapture, live_tensors
from slimckpt.save.modes.writer import AsyncResumeWriter
from slimckpt.save.save_context import SaveContext


class StreamMode(AsyncMode):
    name = "stream"

    def stage(self, ctx: SaveContext, state: dict[str, Any], writer: AsyncResumeWriter) -> Staged:
        target = ctx.target
        capture = StreamCapture(
            state,
            host_budget.budget_bytes(ctx.config),
            step=int(ctx.step),
            live=live_tensors(target.model, target.optimizer),
        )
        return Staged(ctx, capture.state, phase="capture", capture=capture)

    def wait_until_safe_to_step(self, staged: Staged) -> Guard:
        capture = staged.capture
        return Guard(
            remove_hooks=stream_guards.activate(capture, staged.ctx.target.optimizer),
            write_ended=functools.partial(stream_guards.deactivate, capture),
        )

    def finish(self, staged: Staged, writer: AsyncResumeWriter) -> None:
        ctx, capture = staged.ctx, staged.capture
        writer.submit(
            ctx.step,
            ctx.local_path,
            functools.partial(step_write.write_and_commit, dataclasses.replace(ctx, capture=capture), staged.state),
            self.name,
            arm=functools.partial(self.wait_until_safe_to_step, staged),
            capture=capture,
        )


__all__ = ["StreamMode"]
