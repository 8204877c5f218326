"""The background writer of async_save's modes (slimckpt.save.modes), and the pool mode's
staging pool: a write on a background thread (async_save=pool: from a host staging pool;
async_save=stream: from the live shards, slimckpt.save.modes.stream_capture).

The training step is blocked only while the rank's tensors are copied into a host staging pool.
The pool is allocated at the first async save and reused by every later one, so
it is held for the whole run: its size is the rank's model+optimizer shard bytes, and a rank
whose shard would exceed `host_memory_budget_gb` does not stage at all: it streams synchronously
(bounded memory) and logs that it did.

One writer per FSDPCheckpointManager, one write in flight: a new save (or a load) first waits for
the previous write and its commit; a failure there is raised by that next call. A rank's write
ends only once the commit's outcome is known on every rank (step_commit.commit), so a rank
whose own files are done still waits for rank 0's manifest; a load, verify or merge of that dir
by other code of this process waits too (slimckpt.storage.in_flight). At interpreter
exit pending writes are finished (atexit); a process killed mid-write leaves a step without its
manifest, which loads refuse and the tracker never names.

On CUDA (chosen per save: any staged tensor on a CUDA device) the pool is pinned and the
device-to-host copies are issued with non_blocking=True on a dedicated side stream, which first
waits for the training stream (so it copies the values as of the save call). The host is then
blocked only for launching the copies, not for the copies themselves; two orderings keep the
staged copy consistent: the training stream waits for the copies' event before any later kernel
(so an optimizer step cannot overwrite a tensor mid-copy), and the background writer waits for
the same event before it reads the pool. Sources are marked as used by the side stream so the
caching allocator cannot hand their memory to training before the copies end (FSDP1's sharded
state dict is a temporary). On CPU none of this runs: plain copies into pageable memory.
`python -m slimckpt_testing.gpu_check` (scripts/gpu_check.sh) checks and times these paths on a GPU.
"""

from __future__ import annotations

import atexit
import copy
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import slimckpt.dist.heartbeat as peers  # noqa: F401 - its exit hook registered before finish_all's, so it runs after it
from slimckpt.log import get_logger
from slimckpt.save.host_budget import budget_bytes
from slimckpt.save.target import TargetState
from slimckpt.storage import in_flight

log = get_logger("slimckpt.resume")

_WRITERS: weakref.WeakSet[AsyncResumeWriter] = weakref.WeakSet()
_LOCK = threading.Lock()


def tensors_in(obj: Any):
    """Every tensor of a nested state dict (dicts, lists, tuples), in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(state: Any) -> int:
    """Bytes of this rank's tensors in a state dict (local shards of DTensors)."""
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors_in(state))


def _signature(state: Any) -> tuple:
    return tuple((tuple(local_tensor(t).shape), local_tensor(t).dtype, type(t).__name__) for t in tensors_in(state))


def _unregister(data_ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(data_ptr)


def cuda_device_of(tensors: list[torch.Tensor]) -> torch.device | None:
    """The CUDA device of the first CUDA tensor, or None (CPU training, or no CUDA build)."""
    if not torch.cuda.is_available():
        return None
    for t in tensors:
        local = local_tensor(t)
        if local.device.type == "cuda":
            return local.device
    return None


class StagingPool:
    """Host copies of a state dict's tensors, allocated once and refilled at every save.

    Each tensor gets a host buffer of exactly its bytes, allocated once at its final size (no
    temporary copies), so the pool is the state's size. On CUDA the buffers are page-locked in
    place (cudaHostRegister), not taken from torch's pinned allocator, which rounds every block up
    to a power of two (up to twice the budget). A DTensor is staged as a DTensor with the same spec
    (mesh, placements, global shape) around its buffer, so DCP plans the same chunks as for the
    live tensor; non-tensor leaves (optimizer hyper-parameters) are copied at every save."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._signature: tuple | None = None
        self.nbytes = 0
        self.pinned = False
        self._unpin: list[weakref.finalize] = []  # unregister each page-locked buffer
        self._stream = None  # the side stream of the device-to-host copies (CUDA only)
        self._ready = None  # CUDA event recorded after the last save's copies

    def _side_stream(self, device: torch.device):
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def wait_ready(self) -> None:
        """Block until the last stage's copies are in host memory (no-op on CPU). The background
        writer calls this before it reads the pool."""
        ready, self._ready = self._ready, None
        if ready is not None:
            ready.synchronize()

    def _release(self) -> None:
        unpin, self._unpin = self._unpin, []
        self._buffers, self.nbytes, self.pinned = [], 0, False
        for finalizer in unpin:
            finalizer()  # each buffer is unregistered before it is freed

    def _pin(self, buf: torch.Tensor) -> bool:
        """Page-lock `buf` in place (exactly its bytes); on failure log and leave it pageable
        (correct: that tensor's copy is then synchronous and does not overlap)."""
        nbytes = buf.numel() * buf.element_size()
        err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 1))  # 1: portable
        if err != 0:
            log.warning(
                "async_save: page-locking %.1f MiB of the staging pool failed (cudaError %d); staging the "
                "rest into pageable memory",
                nbytes / 2**20,
                err,
            )
            return False
        finalizer = weakref.finalize(buf, _unregister, buf.data_ptr())
        finalizer.atexit = False  # never after the CUDA context is gone
        self._unpin.append(finalizer)
        return True

    def _allocate(self, tensors: list[torch.Tensor], pin: bool) -> None:
        self._release()  # free (and unpin) the old pool before allocating the new one
        buffers, pinned = [], pin
        for t in tensors:
            local = local_tensor(t)
            # one storage per tensor, of exactly its size: DCP clones a tensor whose storage is
            # larger than it before writing it, so views into one flat pool would be copied again
            buf = torch.empty(tuple(local.shape), dtype=local.dtype)
            if pinned and buf.numel():
                pinned = self._pin(buf)
            if hasattr(t, "to_local"):
                buf = DTensor(buf, t._spec, requires_grad=False)
            buffers.append(buf)
        self._buffers, self.nbytes, self.pinned = buffers, state_bytes(buffers), pin and pinned

    def _fill(self, obj: Any, buffers: Iterator[torch.Tensor], side) -> Any:
        if isinstance(obj, torch.Tensor):
            staged, source = next(buffers), local_tensor(obj)
            on_device = side is not None and source.device.type == "cuda"
            local_tensor(staged).copy_(source, non_blocking=on_device)
            if on_device:
                source.record_stream(side)
            return staged
        if isinstance(obj, dict):
            return {k: self._fill(v, buffers, side) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._fill(v, buffers, side) for v in obj)
        return copy.deepcopy(obj)

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """Copy `state` into the pool; on CUDA the copies may still be running when this returns
        (see the module docstring): read the result only after wait_ready()."""
        self.wait_ready()  # the previous copies must be done before the pool is refilled
        tensors = list(tensors_in(state))
        device = cuda_device_of(tensors)
        pin = device is not None
        signature = (_signature(state), pin)
        if signature != self._signature:
            self._allocate(tensors, pin)
            self._signature = signature
        if device is None:
            return self._fill(state, iter(self._buffers), None)
        side, training = self._side_stream(device), torch.cuda.current_stream(device)
        side.wait_stream(training)  # copy the values as of now, after every queued kernel
        with torch.cuda.stream(side):
            staged = self._fill(state, iter(self._buffers), side)
            ready = torch.cuda.Event()
            ready.record(side)
        training.wait_event(ready)  # later training kernels cannot overwrite a tensor mid-copy
        self._ready = ready
        return staged


class AsyncResumeWriter:
    """The background write of one target's saves."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slimckpt-ckpt-write")
        self._future: Future | None = None
        self._step: int | None = None
        self._path: str | None = None
        self._after_commit: list[Callable[[], None]] = []
        self.pool = StagingPool()
        self.mode: str | None = None  # the async_save mode of the write in flight (or the last one)
        self.capture = None  # stream mode: the StreamCapture of the write in flight (or the last one)
        self._unhook: Callable[[], None] | None = None

    @property
    def pending(self) -> bool:
        return self._future is not None

    @property
    def step(self) -> int | None:
        """The step of the write in flight (None when there is none)."""
        return self._step if self._future is not None else None

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the writer thread once the write in flight has committed (not if it
        fails). For measurement: a failing callback is logged, never fails the step."""
        if self._future is None:
            raise RuntimeError("slimckpt: no background checkpoint write in flight")
        self._after_commit.append(callback)

    def stage(self, state: dict[str, Any], config: Any, step: int, group=None) -> dict[str, Any] | None:
        """The staged copy, or None when the largest rank's state is over the host-memory budget
        (decided together over `group`, so that no rank writes in the background while another
        blocks)."""
        need, budget = state_bytes(state), budget_bytes(config)
        if group is not None:
            # the largest need against the smallest budget (host_memory_budget_gb=auto differs by node)
            largest = torch.tensor([need, -budget], dtype=torch.int64)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
            need, budget = int(largest[0].item()), -int(largest[1].item())
        if need > budget:
            log.warning(
                "async_save step %s: the largest rank's state is %.2f GiB, over host_memory_budget_gb (%.2f GiB); "
                "streaming it synchronously instead (raise the budget to save in the background)",
                step,
                need / 2**30,
                budget / 2**30,
            )
            return None
        started = time.perf_counter()
        staged = self.pool.stage(state)
        log.debug("staged step %s: %.1f MiB in %.2f s", step, need / 2**20, time.perf_counter() - started)
        return staged

    def submit(self, step: int, path: str, write: Callable[[], None], mode: str, arm=None, capture=None) -> None:
        """Write in the background. `mode`: the async_save mode's name, for reports. `arm` (the
        mode's wait_until_safe_to_step) runs here, before the write starts; what it returns (an
        async_modes.base.Guard) has its `remove_hooks` called on this thread at the next wait or
        save and its `write_ended` on the writer's thread once the write ends. `capture`: stream
        mode's StreamCapture, kept for the reports' counters."""
        if self._future is not None:
            raise RuntimeError("slimckpt: a background checkpoint write is already in flight")
        self._remove_hook()
        self._step, self._path = step, path
        self._after_commit = []
        self.mode, self.capture = mode, capture
        guard = arm() if arm is not None else None
        if guard is not None:
            self._unhook = guard.remove_hooks
        registered = in_flight.begin(path)  # a load, verify or merge of this dir in this process waits for it
        ended = guard.write_ended if guard is not None else None
        self._future = self._executor.submit(self._ready_then, write, ended, registered)
        self._future.add_done_callback(lambda _: in_flight.end(registered))  # also if it never ran

    def _remove_hook(self) -> None:
        unhook, self._unhook = self._unhook, None
        if unhook is not None:
            unhook()

    def _ready_then(self, write: Callable[[], None], ended: Callable[[], None] | None, registered) -> None:
        in_flight.running(registered)
        try:
            self.pool.wait_ready()  # CUDA: the staged copies are complete before anything reads them
            write()  # returns (or raises) on every rank once the commit's outcome is known to all
        finally:
            in_flight.end(registered)
            if ended is not None:  # stream: no guard waits for (and nothing holds) the live shards any more
                ended()
        for callback in self._after_commit:
            try:
                callback()
            except Exception:  # noqa: BLE001 - the step is committed; a report must not undo that
                log.exception("after the commit of step %s", self._step)

    def wait(self) -> None:
        """Block until the write in flight is committed; re-raise its failure."""
        future, self._future = self._future, None
        if future is None:
            self._remove_hook()
            return
        try:
            future.result()
        except BaseException as exc:
            raise RuntimeError(
                f"slimckpt: the background write of step {self._step} to {self._path} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self._remove_hook()


def writer_for(state: TargetState) -> AsyncResumeWriter:
    """The target's background writer, made at its first use."""
    with _LOCK:
        writer = state.writer
        if writer is None:
            writer = state.writer = AsyncResumeWriter()
            _WRITERS.add(writer)
        return writer


def finish_all() -> None:
    """Finish every pending write of this process; log (not raise) failures."""
    for writer in list(_WRITERS):
        if writer.pending:
            log.info("waiting for the background checkpoint write of step %s to finish", writer._step)
            try:
                writer.wait()
            except Exception as exc:  # noqa: BLE001 - exiting: report, the step stays uncommitted
                log.error("%s; that step stays uncommitted and will not be loaded", exc)


atexit.register(finish_all)
