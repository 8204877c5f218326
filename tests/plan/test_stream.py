"""plan/stream: what a stream save blocks, copies and waits for at the next step."""

from __future__ import annotations

import pytest


def test_stream_model_blocks_only_when_the_step_comes_before_the_write_ends():
    from slimckpt.plan.stream import stream_block, windows_for

    gib = 2**30
    # 10 GiB written in 100 s; the next step 100 s or later after the save: nothing to do
    assert stream_block(10 * gib, 100.0, 100.0, 4 * gib).pending_bytes == 0
    assert stream_block(10 * gib, 100.0, 250.0, 0, copy_gbps=5).blocked_s == 0.0
    # at 60 s, 4 GiB unread: all fit the budget: copied, no wait
    fit = stream_block(10 * gib, 100.0, 60.0, 4 * gib, copy_gbps=2)
    assert fit.pending_bytes == 4 * gib and fit.copied_bytes == 4 * gib and fit.wait_s == 0.0
    assert fit.blocked_s == pytest.approx(4 * gib / 2e9)
    # at 0 s with a 2 GiB budget: copy 2 GiB, wait for the writer to release the other 8 (80 s)
    over = stream_block(10 * gib, 100.0, 0.0, 2 * gib)
    assert over.copied_bytes == 2 * gib and over.wait_s == pytest.approx(80.0) and over.blocked_s is None
    # budget 0: waits for the rest of the write
    assert stream_block(10 * gib, 100.0, 30.0, 0).wait_s == pytest.approx(70.0)
    assert windows_for(100.0, None) == [0.0, 25.0, 50.0, 100.0, 200.0] and windows_for(1.0, [9.0, 3.0]) == [3.0, 9.0]
