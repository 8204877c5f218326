"""Stream mode of async_save: the background writer reads the live shards, no staging copy.

Between a save (after the updates of step N) and the next change to the weights (the optimizer
step of step N+1) verl runs the rollout, reward and reference passes: the shards do not change.
A StreamCapture holds, for one save, references to the rank's shard tensors (the local tensors of
DTensors, the optimizer state) and the version counters an in-place change of each would bump (see
"Which counters" below); the small state (optimizer hyper-parameters, any non-tensor leaf) is
copied at capture. The writer reads each source through `begin`/`end`; DCP and the HF export are its
readers, and a source is done when all the reads planned for it have ended.

Guards (slimckpt.save.modes.stream_guards) call `guard()` before anything that can change a source: it
copies every source not yet done into host memory, within `budget_bytes`, and blocks only until
the writer has finished the ones that do not fit (and any it is reading at that moment). After a
guard no live source is left, so later guards return at once.

On CUDA the writer copies each source to pinned host memory on a side stream that first waits for
an event recorded at the capture (the values as of the save, not behind kernels queued later) and
ends the read once that copy is done; a guard's copies run on the training stream, before the
mutation is queued.

Moves (verl's param/optimizer offload and reload, slimckpt.save.modes.stream_guards): a move copies
tensors to new storage and changes none in place, so it is followed, not guarded. After an
offload an unread source reads the host copy and every holder of the old tensor (the state dict's
entries, DCP's flattened dict) has its contents swapped for a tensor around that copy, so nothing
pins the device tensor; after a reload an unread source keeps reading the host tensor (`held`: no
guard copies it). A followed or held host tensor is freed once read (its holders emptied).

Safety net: `end` compares the source's version with the captured one, and a guard compares it
before copying. A change is recorded as the capture's failure (the first, in one line naming the
tensor); `check_collective` raises it on every rank before the commit, so a changed tensor is
never committed. Reads continue meanwhile: a failed step is never committed, and no rank stops
half-way through a collective.

Which counters: a DTensor and its local tensor have separate version counters, and in torch 2.13
an in-place op on an FSDP2 parameter (`p.add_` under no_grad, `p.copy_`, `load_state_dict`, an
optimizer step) bumps only the DTensor's, which the parameter shares with its state-dict alias;
one on `p.to_local()` bumps only the parameter's local tensor, which the alias's local tensor does
not share. So each source watches its state-dict entry, that entry's local tensor, and every live
tensor passed as `live` (the model's parameters and buffers, the optimizer's state) that views the
same memory, with its local tensor. FSDP1's sharded state dicts are new tensors (chunks cut and
cloned from the unsharded parameters and the flat optimizer state): no live tensor views them and
a change to the parameters after the save cannot reach what is written. A change through
`p.data` bumps no counter at all (`.data` is a new tensor with its own counter): it is not
detected; checksumming every shard at capture would catch it but reads the whole state in the
save's foreground, the cost stream mode exists to avoid.

Test hook: `READ_HOOK` (a callable taking the source name) runs on the writer's thread before
each read of a live source, so a test can pause the writer at a known point without sleeps.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from slimckpt import SlimckptError
from slimckpt.dist import outcome
from slimckpt.log import get_logger

log = get_logger("slimckpt.resume")

READ_HOOK: Callable[[str], None] | None = None


class StreamMutationError(SlimckptError, RuntimeError):
    """A captured shard changed before the writer had read it."""


def view_key(t: torch.Tensor) -> tuple | None:
    """Identity of the memory a tensor views (the same for every view object DCP makes of it)."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    return (
        t.device.type,
        t.device.index,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
    )


def _local(t: Any) -> torch.Tensor:
    # a DTensor's local tensor as it is: to_local() builds an autograd view each call (~30 us,
    # paid per tensor at every capture and read)
    inner = getattr(t, "_local_tensor", None)
    if inner is not None:
        return inner
    return t.to_local() if hasattr(t, "to_local") else t


def _counters(t: torch.Tensor) -> list[torch.Tensor]:
    """`t` and, for a DTensor, its local tensor: their version counters are separate."""
    inner = getattr(t, "_local_tensor", None)
    return [t] if inner is None else [t, inner]


def live_tensors(model: Any, optimizer: Any) -> list[torch.Tensor]:
    """The tensors user code changes in place: parameters, buffers, optimizer state."""
    out: list[torch.Tensor] = []
    if model is not None:
        out += list(model.parameters()) + list(model.buffers())
    for state in (getattr(optimizer, "state", None) or {}).values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


@dataclass
class Source:
    """One captured tensor: the live local tensor until done or copied, and the tensors whose
    version counters an in-place change of its memory bumps (`version`: theirs at capture)."""

    name: str
    live: torch.Tensor | None
    watched: list[torch.Tensor]
    version: tuple[int, ...]
    nbytes: int
    reads_left: int = 1
    reading: int = 0
    copy: torch.Tensor | None = None
    readers: dict[str, int] = field(default_factory=dict)
    # the state's tensor objects (capture.state, DCP's flattened dict) whose local tensor `live` is
    holders: list[torch.Tensor] = field(default_factory=list)
    held: bool = False  # training moved on to a new tensor (a reload): `live` is read, never changed
    followed: bool = False  # an offload moved it: `live` and the holders view verl's host copy
    orphan: bool = False  # no live tensor viewed it at capture (FSDP1's state dict is made of new tensors)
    ready: Any = None  # CUDA event: the offload's copy into `live` is complete once it has passed

    @property
    def guarded(self) -> bool:
        """A guard must copy it (or wait for the writer) before training may change it."""
        return not self.done and self.copy is None and self.live is not None and not self.held

    @property
    def done(self) -> bool:
        return self.reads_left <= 0

    @property
    def changed(self) -> bool:
        return tuple(t._version for t in self.watched) != self.version

    def release(self, copy: torch.Tensor | None = None) -> None:
        """Nothing reads the live tensor any more: drop it (and what watched it). A host copy an
        offload or reload left to the write is freed here, not when the write ends: its holders
        (the write's own references, no training tensor) are emptied."""
        if self.followed or self.held:
            self.empty_holders()
        self.live, self.watched, self.copy, self.ready = None, [], copy, None

    def empty_holders(self, keep: Iterable[torch.Tensor] = ()) -> None:
        """Drop the holders' memory: their local tensors made empty (but those in `keep`)."""
        kept = {id(t) for t in keep}
        with torch.no_grad():
            for holder in self.holders:
                if id(holder) not in kept:
                    _local(holder).set_()
        self.holders = []

    def rewatch(self, extra: Iterable[torch.Tensor] = ()) -> None:
        """Watch `live`, the holders and `extra` from now on, at their versions now."""
        tensors = [self.live] if self.live is not None else []
        for t in [*self.holders, *extra]:
            tensors += _counters(t)
        self.watched = list({id(t): t for t in tensors}.values())
        self.version = tuple(t._version for t in self.watched)


def _host_copy(t: torch.Tensor, side=None, after=None) -> torch.Tensor:
    """`t` in fresh host memory, same shape and strides (what DCP and the export read from it is
    then what they would have read from `t`). A device tensor with a `side` stream: copied there
    into pinned memory without blocking the training stream; `after` (the event recorded at the
    capture) orders the copy after the kernels that produced the saved values; returns once the
    copy is done."""
    if side is None or t.device.type != "cuda":
        out = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="cpu")
        out.copy_(t.detach())
        return out
    out = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="cpu", pin_memory=True)
    with torch.cuda.stream(side):
        if after is not None:
            side.wait_event(after)
        out.copy_(t.detach(), non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    return out


class StreamCapture:
    """One save's sources and the protocol between the writer (begin/end) and guards."""

    def __init__(
        self, state: dict[str, Any], budget_bytes: int, step: int, live: list[torch.Tensor] | tuple = ()
    ) -> None:
        self.step = step
        self.budget_bytes = int(budget_bytes)
        self.copied_bytes = 0
        self.blocked_s = 0.0
        self.guards = 0
        self.failure: str | None = None
        self.closed = False
        self._cond = threading.Condition()
        self._sources: dict[tuple, Source] = {}
        self._reading_on: dict[int, tuple] = {}  # writer thread id -> the source DCP last handed it
        self._live: dict[tuple, list[torch.Tensor]] = {}
        for t in live:
            key = view_key(_local(t))
            if key is not None:
                self._live.setdefault(key, []).extend(_counters(t))
        self.state = self._capture(state, "")
        self._live = {}
        self._current: dict[tuple, Source] = dict(self._sources)  # by the key of each source's tensor now
        self._moved: dict[tuple, Source] = {}  # the keys of the host copies sources followed an offload to
        self.followed_bytes = 0  # moved by an offload: now read from the host copy verl made
        self.held_bytes = 0  # replaced by a reload before the writer read them: their host copy kept
        # on CUDA the writer copies to the host on its own stream, after the kernels queued so far
        self._side = self._captured = None
        device = next((s.live.device for s in self._sources.values() if s.live.device.type == "cuda"), None)
        if device is not None:
            self._side = torch.cuda.Stream(device=device)
            self._captured = torch.cuda.Event()
            self._captured.record(torch.cuda.current_stream(device))

    # ------------------------------------------------------------------ capture

    def _capture(self, obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            local = _local(obj)
            key = view_key(local)
            if key is not None and key not in self._sources:
                watched = list({id(t): t for t in _counters(obj) + self._live.get(key, [])}.values())
                self._sources[key] = Source(
                    path,
                    local,
                    watched,
                    tuple(t._version for t in watched),
                    local.numel() * local.element_size(),
                    holders=[obj],
                    orphan=key not in self._live,
                )
            elif key is not None and all(h is not obj for h in self._sources[key].holders):
                self._sources[key].holders.append(obj)
            return obj  # by reference: DCP plans from the DTensor itself
        if isinstance(obj, dict):
            return {k: self._capture(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._capture(v, f"{path}[{i}]") for i, v in enumerate(obj))
        return copy.deepcopy(obj)  # hyper-parameters: the lr scheduler changes them in place

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._sources.values())

    def plan_reads(self, reader: str, keys: Iterable[tuple]) -> None:
        """The reads `reader` will make (one per key, a key may repeat); every reader plans before
        `start`, and none reads before it."""
        with self._cond:
            for key in keys:
                source = self._source(key)
                if source is not None:
                    source.readers[reader] = source.readers.get(reader, 0) + 1

    def start(self) -> None:
        """Every reader has planned: each source now waits for exactly its planned reads, and one
        no reader plans to read on this rank (DCP writes a replicated tensor on one rank only) is
        released at once. Until then a guard treats every source as unread."""
        with self._cond:
            for source in self._sources.values():
                source.reads_left = sum(source.readers.values())
                if source.done:
                    source.release()
            self._cond.notify_all()

    def _source(self, key: tuple) -> Source | None:
        """The source a key names: its tensor at capture, or the copy it followed an offload to."""
        source = self._sources.get(key)
        return source if source is not None else self._moved.get(key)

    def key_of(self, t: torch.Tensor) -> tuple | None:
        return view_key(_local(t))

    # ------------------------------------------------------------------ writer side

    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            log.error("%s", message)

    def _changed(self, source: Source, when: str) -> None:
        self._fail(
            f"slimckpt: async_save=stream step {self.step}: tensor {source.name} was changed in place "
            f"{when}; this step is not committed (async_save=stream reads the live shards until the "
            f"write ends: change them in place only through the optimizer's step, or save with "
            f"async_save=pool)"
        )

    def begin(self, key: tuple | None, fallback: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(the tensor to read for source `key`, whether it is the live one): its guard copy, or
        the live tensor, marked as being read until `end`; `fallback` for a tensor that was not
        captured."""
        source = self._source(key) if key is not None else None
        if source is None:
            return fallback, False
        hook = READ_HOOK
        if hook is not None and source.copy is None and not self.closed:
            hook(source.name)
        with self._cond:
            if source.copy is not None:
                return source.copy, False
            if source.live is None:  # released (the write ended): nothing left to guard
                return fallback, False
            if source.changed:
                self._changed(source, "after the save and before the writer read it")
            source.reading += 1
            live, ready = source.live, source.ready
        if ready is not None:  # an offload's non-blocking copy to the host: read it once it is done
            ready.synchronize()
        return live, True

    def end(self, key: tuple | None, was_live: bool) -> None:
        """A read of `key` is complete: check its version, count it, release the source when it
        was the last planned read."""
        source = self._source(key) if key is not None else None
        if source is None:
            return
        with self._cond:
            if source.reading and was_live:
                source.reading -= 1
                if source.live is not None and source.changed:
                    self._changed(source, "while the writer read it")
            source.reads_left -= 1
            if source.done:
                source.release()
            self._cond.notify_all()

    # DCP hands each writer thread its items one at a time on CPU (read while torch.save writes
    # it); the thread's next resolve, or the end of the DCP phase, ends the previous read.
    def dcp_begin(self, key: tuple | None, fallback: torch.Tensor) -> torch.Tensor:
        me = threading.get_ident()
        with self._cond:
            previous = self._reading_on.pop(me, None)
        if previous is not None:
            self.end(previous[0], previous[1])
        source = self._source(key) if key is not None else None
        if source is None:
            return fallback
        t, was_live = self.begin(key, fallback)
        if t.device.type != "cpu":  # copied to the host here, the read is over on return
            host = _host_copy(t, self._side, self._captured)
            self.end(key, was_live)
            return host
        with self._cond:  # a host tensor (an offload's copy, a guard's copy): read while DCP writes it
            self._reading_on[me] = (key, was_live)
        return t

    def dcp_done(self) -> None:
        with self._cond:
            pending, self._reading_on = list(self._reading_on.values()), {}
        for key, was_live in pending:
            self.end(key, was_live)

    # ------------------------------------------------------------------ guard side

    def guard(self, what: str, which: Callable[[Source], bool] = lambda s: True) -> float:
        """Before `what` changes the shards: copy the sources not yet done (within the budget),
        wait for the writer for the rest; `which` limits it to some sources. A source a reload
        left behind (`held`) needs neither. Returns the seconds this call blocked."""
        started = time.perf_counter()
        with self._cond:
            if self.closed or not any(s.guarded and which(s) for s in self._sources.values()):
                return 0.0
            self.guards += 1
            waited = False
            while not self.closed:
                pending = [s for s in self._sources.values() if s.guarded and which(s)]
                if not pending:
                    break
                for source in pending:
                    if source.reading or self.copied_bytes + source.nbytes > self.budget_bytes:
                        continue
                    if source.changed:
                        self._changed(source, f"before {what} (found by its guard)")
                    if source.ready is not None:  # an offload's copy into it may still be running
                        source.ready.synchronize()
                    source.release(_host_copy(source.live))
                    self.copied_bytes += source.nbytes
                if not any(s.guarded and which(s) for s in self._sources.values()):
                    break
                waited = True
                self._cond.wait(timeout=1.0)
        blocked = time.perf_counter() - started
        self.blocked_s += blocked
        log.info(
            "async_save=stream step %s: %s waited %.3f s for the writer (%.1f MiB copied within "
            "host_memory_budget_gb)%s",
            self.step,
            what,
            blocked,
            self.copied_bytes / 2**20,
            "" if waited else ", no wait",
        )
        return blocked

    # ------------------------------------------------------------------ moves (offload, reload)

    def before_move(self, tensors: list[tuple[str, Any]], what: str) -> list:
        """verl is about to move `tensors` ((name, tensor) of a model or optimizer) to new
        storage. The move copies them, it changes none in place: check the sources they view
        are as captured, and stop watching the moved objects themselves (a module's move swaps
        a DTensor parameter's contents, which gives it another version counter). Returns what
        `after_move` needs."""
        token = []
        with self._cond:
            moving = {id(c) for _, t in tensors for c in _counters(t)}
            for name, t in tensors:
                old = _local(t)
                key = view_key(old)
                source = self._current.get(key) if key is not None else None
                if source is None or (not source.guarded and not (source.done and source.holders)):
                    continue
                if not source.guarded:  # read already: after the move only its holders pin the old tensor
                    token.append((name, key, source))
                    continue
                if source.changed:
                    self._changed(source, f"before {what}")
                source.rewatch()
                source.watched = [w for w in source.watched if id(w) not in moving] or source.watched
                source.version = tuple(w._version for w in source.watched)
                token.append((name, key, source))
        return token

    def after_move(self, token: list, now: dict[str, Any], offload: bool, ready: Any = None) -> None:
        """The move is done; `now`: the same names' tensors after it. An offload: each source
        follows its tensor to the host copy verl made (every holder of the old tensor is pointed
        at the copy, so the device memory is released once nothing reads it). A reload: the
        source keeps the host tensor it reads (a reference: verl's copy, not one of ours), and
        training's changes to the new one cannot reach it, so no guard copies it."""
        with self._cond:
            live_now = [c for t in now.values() for c in _counters(t)]
            for name, key, source in token:
                new = now.get(name)
                new_local = _local(new) if new is not None else None
                moved = new_local is None or view_key(new_local) != key
                if not source.guarded:
                    if moved and source.done:  # the write needs it no more, training neither: free it
                        source.empty_holders(keep=live_now)
                    continue
                if not moved:  # already where the move puts it
                    source.rewatch([new])
                    continue
                if offload and new_local is not None and self._follow(source, new_local):
                    del self._current[key]
                    self._current[view_key(new_local)] = self._moved[view_key(new_local)] = source
                    source.ready = ready
                    source.rewatch([new])
                    self.followed_bytes += source.nbytes
                    continue
                # a reload (or a copy the holders cannot be pointed at): keep the tensor read so far
                del self._current[key]
                source.held = True
                source.rewatch()
                self.held_bytes += source.nbytes
            self._cond.notify_all()

    def _follow(self, source: Source, new_local: torch.Tensor) -> bool:
        """Point `source` and every holder of its tensor at `new_local`. Each holder's contents
        are swapped with a tensor around `new_local` (torch.utils.swap_tensors, as a module's
        move does with its parameters), so DCP's flattened dict and every other reference see
        the copy. False where a holder cannot be swapped: the source keeps the old tensor."""
        if tuple(new_local.shape) != tuple(source.live.shape) or new_local.dtype != source.live.dtype:
            return False
        # `.data`: views of the copy with version counters of their own, so that a module whose
        # move sets `param.data` (plain parameters) and later reloads the same way does not take
        # the tensor read here with it
        replacements = []
        for holder in source.holders:
            if view_key(_local(holder)) == view_key(new_local):
                continue
            inner = getattr(holder, "_local_tensor", None)
            if inner is not None:
                replacements.append((holder, DTensor(new_local.data, holder._spec, requires_grad=False)))
            elif type(holder) is torch.Tensor:
                replacements.append((holder, new_local.data))
            else:
                return False
        done = []
        try:
            for holder, replacement in replacements:
                torch.utils.swap_tensors(holder, replacement)
                done.append((holder, replacement))
        except RuntimeError as exc:  # another reference to the old tensor: undo, keep it
            for holder, replacement in reversed(done):
                torch.utils.swap_tensors(holder, replacement)
            log.warning(
                "async_save=stream step %s: %s stays on %s until written (%s)",
                self.step,
                source.name,
                source.live.device,
                exc,
            )
            return False
        source.live = new_local.data
        source.followed = True
        return True

    def close(self) -> None:
        """The write ended (committed or failed): drop every reference, wake every guard. The
        captured state goes too: the writer keeps its last capture (for its counters), and its
        tensors, once training has moved on from them (a reload), are no one else's."""
        with self._cond:
            self.closed = True
            for source in self._sources.values():
                source.release()
                source.holders = []
            self.state = {}
            self._current, self._moved = {}, {}
            self._cond.notify_all()

    # ------------------------------------------------------------------ outcome

    def check_collective(self, group) -> None:
        """Before the commit, on every rank: raise the first rank's recorded failure, one line
        (naming the rank it happened on, on the other ranks)."""
        rank = dist.get_rank(group)
        mine = outcome.Failure(rank, self.failure) if self.failure else None
        outcome.agree(
            group,
            mine,
            lambda failure: StreamMutationError(
                failure.line if failure.rank == rank else f"{failure.line} (rank {failure.rank})"
            ),
        )


class StreamReads:
    """The HF export's reads of a capture's model tensors (hf_direct_write.write_export)."""

    def __init__(self, capture: StreamCapture, model_state: dict[str, Any]) -> None:
        self.capture, self.model_state = capture, model_state
        self._open: dict[str, tuple[tuple | None, bool]] = {}

    def keys_for(self, names: Iterable[str]) -> list[tuple]:
        return [k for n in names if (k := self.capture.key_of(self.model_state[n])) is not None]

    def begin(self, name: str) -> Any:
        value = self.model_state[name]
        key = self.capture.key_of(value)
        local, was_live = self.capture.begin(key, _local(value))
        self._open[name] = (key, was_live)
        return local

    def end(self, name: str) -> None:
        key, was_live = self._open.pop(name, (None, False))
        self.capture.end(key, was_live)
