"""DCP's SavePlanner for async_save=stream: every tensor DCP writes is read through the capture.

`finish_plan` (DCP's final plan for this rank) tells the capture which sources DCP reads here;
`resolve_data` hands DCP the source's guard copy or the live tensor, and ends the thread's
previous read (DCP writes a thread's items one after the other; on an accelerator the read is a
copy to the host made right there). Plans, metadata and file bytes are DefaultSavePlanner's.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from slimckpt.save.modes.stream_capture import StreamCapture


class StreamSavePlanner(DefaultSavePlanner):
    def __init__(self, capture: StreamCapture) -> None:
        super().__init__()
        self.capture = capture

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        plan = super().finish_plan(new_plan)
        keys = [
            self.capture.key_of(self.lookup_object(item.index))
            for item in plan.items
            if item.type != WriteItemType.BYTE_IO
        ]
        self.capture.plan_reads("dcp", [k for k in keys if k is not None])
        self.capture.start()
        return plan

    def resolve_data(self, write_item) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        live = self.lookup_object(write_item.index)
        return self.capture.dcp_begin(self.capture.key_of(live), live)
