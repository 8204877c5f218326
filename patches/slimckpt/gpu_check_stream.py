"""async_save=stream on one CUDA device, for `python -m slimckpt.gpu_check` (no verl, no DCP):
the writer's side-stream reads into pinned memory, a guard's copy before an in-place update, and
the version check catching an unguarded in-place update that races the writer.

Checks (PASS/FAIL):
  stream_read_equal     a writer thread reads every source of a shard-like state (side stream,
                        pinned, non_blocking, after the capture's event) while the training stream
                        runs matmuls: the host copies equal the values at the capture, and are pinned
  stream_guard_copy     the writer paused after its first read; the optimizer step's guard copies the
                        rest within the budget; the step then overwrites every source in place; the
                        writer, resumed, still writes the captured values; no failure recorded
  stream_version_catch  the writer paused; an in-place update with no guard; the writer, resumed,
                        records a one-line failure naming that tensor
Timings: the writer's reads alone, with the matmuls at once (overlap), and the guard's copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch


def _reader(capture, keys_and_live, out: list) -> threading.Thread:
    """DCP's order of calls on one writer thread: begin each item, the thread's next begin ends it."""

    def run() -> None:
        for key, live in keys_and_live:
            t = capture.dcp_begin(key, live)
            out.append((t.clone(), t.is_pinned()))  # what DCP serializes before its next item
        capture.dcp_done()

    thread = threading.Thread(target=run, name="gpu-check-stream-writer")
    thread.start()
    return thread


def _capture(state: dict[str, Any], budget: int, step: int, device: torch.device):
    from .save.resume_async import tensors_in
    from .save.stream_capture import StreamCapture

    capture = StreamCapture(state, budget, step)
    items = [(capture.key_of(t), t) for t in tensors_in(capture.state) if t.device.type == device.type and t.numel()]
    capture.plan_reads("dcp", [k for k, _ in items])
    capture.start()
    return capture, items


def _matmuls(device: torch.device) -> None:
    a = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        a = a @ a
        a = a / a.norm()


def check_stream(device: torch.device, total_bytes: int, make_state: Callable[..., dict[str, Any]],
                 clone: Callable[[Any], Any], overwrite: Callable[[dict[str, Any]], None]
                 ) -> tuple[dict[str, bool], dict[str, float]]:
    """gpu_check's shard-like state (`make_state`), its deep copy to the host (`clone`) and its
    optimizer-step stand-in (`overwrite`, in place on the training stream)."""
    from .save import stream_capture

    checks, times = {}, {}
    state = make_state(total_bytes, device, seed=1)
    torch.cuda.synchronize()

    # 1. reads on the side stream while the training stream computes
    capture, items = _capture(state, 0, 1, device)
    out: list = []
    t0 = time.perf_counter()
    _reader(capture, items, out).join()
    times["stream_read_alone_s"] = time.perf_counter() - t0
    capture, items = _capture(state, 0, 2, device)
    out = []
    t0 = time.perf_counter()
    thread = _reader(capture, items, out)
    _matmuls(device)
    thread.join()
    torch.cuda.synchronize()
    times["stream_read_with_compute_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    _matmuls(device)
    torch.cuda.synchronize()
    times["compute_alone_s"] = time.perf_counter() - t0
    wanted = [clone(t) for t in (live for _, live in items)]
    checks["stream_read_equal"] = capture.failure is None and len(out) == len(wanted) and all(
        pinned and torch.equal(o, w.cpu()) for (o, pinned), w in zip(out, wanted))

    # 2. the guard copies what is unread, then the step overwrites in place
    pause, go = threading.Event(), threading.Event()
    count = [0]

    def hook(_name: str) -> None:
        count[0] += 1
        if count[0] == 2:
            pause.set()
            go.wait(60)

    stream_capture.READ_HOOK = hook
    try:
        capture, items = _capture(state, 2 * total_bytes, 3, device)
        before = [clone(live) for _, live in items]
        out = []
        thread = _reader(capture, items, out)
        pause.wait(60)
        t0 = time.perf_counter()
        capture.guard("the optimizer step")
        times["guard_copy_s"] = time.perf_counter() - t0
        times["guard_copied_bytes"] = float(capture.copied_bytes)
        overwrite(state)  # in place, on the training stream, after the guard
        go.set()
        thread.join()
    finally:
        stream_capture.READ_HOOK = None
    checks["stream_guard_copy"] = capture.failure is None and len(out) == len(before) and all(
        torch.equal(o, b.cpu()) for (o, _), b in zip(out, before))

    # 3. an unguarded in-place update while the writer is paused before that tensor
    pause, go, count[0] = threading.Event(), threading.Event(), 0
    stream_capture.READ_HOOK = hook
    try:
        capture, items = _capture(state, 0, 4, device)
        thread = _reader(capture, items, [])
        pause.wait(60)
        victim = next(s for s in capture._sources.values() if s.live is not None and not s.reading)
        victim.live.mul_(2)
        go.set()
        thread.join()
    finally:
        stream_capture.READ_HOOK = None
    checks["stream_version_catch"] = bool(capture.failure) and f"tensor {victim.name} " in capture.failure \
        and "\n" not in capture.failure
    return checks, times
