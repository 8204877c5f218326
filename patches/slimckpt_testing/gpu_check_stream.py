"""async_save=stream on one CUDA device, for `python -m slimckpt_testing.gpu_check` (no verl, no DCP):
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

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from slimckpt.observe.memory import rss_anon_bytes
from slimckpt.save.modes import stream_capture, stream_guards
from slimckpt.save.modes.stream_capture import StreamCapture, live_tensors
from slimckpt.save.modes.writer import tensors_in


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


def check_stream(
    device: torch.device,
    total_bytes: int,
    make_state: Callable[..., dict[str, Any]],
    clone: Callable[[Any], Any],
    overwrite: Callable[[dict[str, Any]], None],
) -> tuple[dict[str, bool], dict[str, float]]:
    """gpu_check's shard-like state (`make_state`), its deep copy to the host (`clone`) and its
    optimizer-step stand-in (`overwrite`, in place on the training stream)."""
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
    checks["stream_read_equal"] = (
        capture.failure is None
        and len(out) == len(wanted)
        and all(pinned and torch.equal(o, w.cpu()) for (o, pinned), w in zip(out, wanted))
    )

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
    checks["stream_guard_copy"] = (
        capture.failure is None
        and len(out) == len(before)
        and all(torch.equal(o, b.cpu()) for (o, _), b in zip(out, before))
    )

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
    checks["stream_version_catch"] = (
        bool(capture.failure) and f"tensor {victim.name} " in capture.failure and "\n" not in capture.failure
    )
    return checks, times


# ---------------------------------------------------------------------------- under verl's offload


def verl_moves(device: torch.device, move: Callable[[torch.Tensor, Any], torch.Tensor] | None = None):
    """verl 0.9.1's FSDP2 offload and reload (verl.utils.fsdp_utils: offload_fsdp2_model_to_cpu,
    load_fsdp2_model_to_gpu, offload_fsdp_optimizer, load_fsdp_optimizer), restated without verl,
    wrapped as slimckpt's patch registry wraps verl's own. `move(t, to)` stands for `t.to(to,
    non_blocking=True)` (a test on a CPU passes one that copies: `.to("cpu")` there moves nothing)."""

    def to(t: torch.Tensor, where: Any) -> torch.Tensor:
        return t.to(where, non_blocking=True) if move is None else move(t, where)

    @torch.no_grad()
    def offload_model(model, empty_cache: bool = True):
        model._apply(lambda t: to(t, "cpu"))  # what model.to("cpu", non_blocking=True) applies
        if empty_cache and device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def load_model(model):
        model._apply(lambda t: to(t, device))

    @torch.no_grad()
    def move_optimizer(optimizer, where):
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state[param]
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = to(value, where)

    return (
        stream_guards.wrap_offload_model(offload_model),
        stream_guards.wrap_load_model(load_model),
        stream_guards.wrap_offload_optimizer(lambda o: move_optimizer(o, "cpu")),
        stream_guards.wrap_load_optimizer(lambda o, d: move_optimizer(o, d)),
    )


def _lookup_reader(capture, paths: list[tuple[Any, Any]], out: list) -> threading.Thread:
    """DCP's reads: each tensor looked up in the captured state when its turn comes (as DCP's
    planner looks it up in its state dict), so no reference to a moved tensor is kept here."""

    def run() -> None:
        for container, name in paths:
            live = container[name]
            local = getattr(live, "_local_tensor", live)
            t = capture.dcp_begin(capture.key_of(local), local)
            out.append((name, t.clone()))
        capture.dcp_done()

    thread = threading.Thread(target=run, name="gpu-check-offload-writer")
    thread.start()
    return thread


def check_stream_offload(
    device: torch.device,
    total_bytes: int,
    move=None,
) -> tuple[dict[str, bool], dict[str, float]]:
    """async_save=stream under param_offload + optimizer_offload, verl's order: the update leaves
    both offloaded, the save reloads the model, captures and returns, then offloads it; the next
    update reloads both and steps. Checks (PASS/FAIL):
      offload_releases_device  after the save's offload (writer paused, sources unread) no tensor
                               the save's reload made is alive (the capture keeps none; on CUDA the
                               allocated bytes are back where they were before the save), nothing
                               copied by the guard
      offload_read_equal       the writer then reads verl's (pinned, non-blocking) host copies: equal
                               to the values at the save
      reload_held_equal        writer paused across the next update (reload, step in place, a `p.add_`
                               no guard sees, offload): it reads the values at the save, nothing copied
    Timings: the save's offload with the capture following it, and verl's alone; host memory
    (RssAnon) the held copies add past the reload. `move`: see verl_moves."""
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def allocated() -> int:
        return torch.cuda.memory_allocated(device) if cuda else 0

    checks: dict[str, bool] = {}
    times: dict[str, float] = {}
    offload_model, load_model, offload_optimizer, load_optimizer = verl_moves(device, move)
    width = 4096 if cuda else 64
    layers = max(2, int(total_bytes // 3 // (width * width * 4)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def update(extra=None) -> None:
        load_model(model)
        load_optimizer(optimizer, device)
        model(torch.randn(8, width, device=device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if extra is not None:
            extra()
        offload_model(model)
        offload_optimizer(optimizer)

    update()
    sync()
    t0 = time.perf_counter()
    load_model(model)
    offload_model(model)  # verl's own round trip, nothing captured
    sync()
    times["offload_round_trip_plain_s"] = time.perf_counter() - t0

    def save(nth_pause: int):
        """verl's FSDPEngine.save_checkpoint with a stream save: (capture, paused writer, values)."""
        load_model(model)
        made = [StorageWeakRef(p.untyped_storage()) for p in model.parameters()]
        state = {"model": {k: v.detach() for k, v in model.state_dict().items()}, "optim": optimizer.state_dict()}
        want = {f"model.{k}": v.detach().cpu().clone() for k, v in state["model"].items()}
        capture = StreamCapture(state, 2 * total_bytes, step=5, live=live_tensors(model, optimizer))
        paths = [(capture.state["model"], k) for k in capture.state["model"]]
        capture.plan_reads("dcp", [capture.key_of(c[k]) for c, k in paths])
        capture.start()
        unhook = stream_guards.activate(capture, optimizer)
        del state
        pause, go, count = threading.Event(), threading.Event(), [0]

        def hook(_name: str) -> None:
            count[0] += 1
            if count[0] == nth_pause:
                pause.set()
                go.wait(120)

        stream_capture.READ_HOOK = hook
        out: list = []
        thread = _lookup_reader(capture, paths, out)
        pause.wait(120)
        return capture, unhook, go, thread, out, want, made

    base = allocated()  # both offloaded
    capture, unhook, go, thread, out, want, made = save(2)
    sync()
    t0 = time.perf_counter()
    offload_model(model)  # the engine's offload after the save: followed
    sync()
    times["offload_following_s"] = time.perf_counter() - t0
    gc.collect()
    times["device_bytes_after_offload_over_before_save"] = float(allocated() - base)
    checks["offload_releases_device"] = (
        all(w.expired() for w in made)
        and allocated() <= base
        and capture.copied_bytes == 0
        and capture.followed_bytes > 0
    )
    times["offload_host_copies_pinned"] = float(all(p.is_pinned() for p in model.parameters()))
    go.set()
    thread.join()
    stream_capture.READ_HOOK = None
    unhook()
    stream_guards.deactivate(capture)
    checks["offload_read_equal"] = (
        capture.failure is None
        and len(out) == len(want)
        and all(torch.equal(t.cpu(), want[f"model.{name}"]) for name, t in out)
    )

    capture, unhook, go, thread, out, want, made = save(2)
    offload_model(model)
    rss = rss_anon_bytes()

    def unguarded():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)

    update(unguarded)  # reload: the unread host copies are kept; the step and the add change the new ones
    sync()
    times["held_rss_extra_bytes"] = float(rss_anon_bytes() - rss)
    times["held_bytes"] = float(capture.held_bytes)
    go.set()
    thread.join()
    stream_capture.READ_HOOK = None
    unhook()
    stream_guards.deactivate(capture)
    checks["reload_held_equal"] = (
        capture.failure is None
        and capture.copied_bytes == 0
        and capture.held_bytes > 0
        and len(out) == len(want)
        and all(torch.equal(t.cpu(), want[f"model.{name}"]) for name, t in out)
    )
    return checks, times
