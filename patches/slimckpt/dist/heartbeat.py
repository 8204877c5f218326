"""Which ranks of a job stopped answering: a heartbeat per process in the job's store.

A collective whose peer died or stalled fails with the backend's words ("Connection closed by
peer", "Timed out waiting 600000ms for recv"), which name a socket, not a rank. Each process that
writes collectively beats a counter `<prefix>/<rank>` in the store once a second from a daemon
thread; a killed process stops beating, and so does a stopped one (SIGSTOP stops every thread).
When a collective fails, `silent()` watches the counters for a few beats and names the ranks whose
counter did not move, so the error can say which rank was lost.

Every read of the counters runs in a helper thread with a bounded wait: the store lives in rank
0's process (or torchrun's agent), and a call to a stalled rank 0 would block until the store's own
timeout. A store that does not answer is itself the answer: its host (rank 0 unless torchrun hosts
it) is gone.

Cost: one small store write per process per second; a failure that loses a peer waits three beats
before it is reported.

This module is **the** memory of which rank a process found lost (`LOST`): the silent ranks,
named once (the job's groups are broken for good, so every later failure is the same loss), and
the line a save reported for it (`dist.lost_rank` asks it before a later save makes a group).

`watch()` adds a watchdog for commands that own their process group (the distributed merge):
a collective there may legitimately wait hours for the other ranks' writes, so the group's timeout
cannot tell a slow rank from a dead one, but a beat that stops for `timeout` seconds can.
"""

# lazy imports: torch only where a process group exists (its error type, its store); describing ranks is torch-free
from __future__ import annotations

import atexit
import contextlib
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from slimckpt import env_vars
from slimckpt import internals
from slimckpt import SlimckptError

BEAT_S = 1.0
CALL_TIMEOUT_S = 5.0
# how long interpreter exit waits for store calls in flight (see end_store_calls): a store that
# answers does so in milliseconds; one that has not after this is held by a stopped or dead host
EXIT_WAIT_S = 1.0
PREFIX = "slimckpt/alive"
# words of gloo's and NCCL's errors when a peer is gone or does not answer
PEER_WORDS = (
    "connection closed by peer",
    "connection reset by peer",
    "timed out waiting",
    "socket timeout",
    "broken pipe",
    "connection refused",
    "ncclremoteerror",
    "nccl watchdog",
    "collective operation timeout",
    "read error",
    "write error",
    "transport",
    "no route to host",
)


class StoreSilent(SlimckptError, RuntimeError):
    """The store did not answer within CALL_TIMEOUT_S."""


def _torch():
    """torch with torch.distributed loaded, imported on first use: describing ranks stays torch-free."""
    import torch.distributed

    return torch


def bounded(call: Callable[[], Any], timeout: float = CALL_TIMEOUT_S) -> Any:
    """`call()` in a daemon thread; its result, its exception, or StoreSilent after `timeout`."""
    box: list = []

    def run() -> None:
        try:
            box.append(("ok", call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append(("error", exc))
        finally:
            with _LIVE_LOCK:
                _CALLS.discard(threading.current_thread())

    thread = threading.Thread(target=run, name="slimckpt-store-call", daemon=True)
    with _LIVE_LOCK:
        _CALLS.add(thread)
    thread.start()
    thread.join(timeout)
    if not box:
        raise StoreSilent(f"the store did not answer within {timeout:.0f} s")
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, what caused it (__cause__, __context__), and DCP's per-rank failures, each once."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            for f in failures.values():
                todo += [x for x in (f if isinstance(f, tuple) else (f,)) if isinstance(x, BaseException)]


def _is_backend_words(e: BaseException) -> bool:
    if not isinstance(e, (RuntimeError, OSError, TimeoutError)):
        return False
    text = str(e).lower()
    # the store's own words when a rank never arrived at a rendezvous (a new group's first collective
    # setup, a store barrier): a bare "Wait timeout" / "wait timeout after 600000ms", naming no backend
    if text.startswith("wait timeout"):
        return True
    return any(w in text for w in PEER_WORDS) and any(
        w in text for w in ("gloo", "nccl", "pair", "timed out", "connection")
    )


def peer_error(exc: BaseException) -> BaseException | None:
    """The error in `exc`'s chain (itself, its causes, DCP's per-rank failures) that says a collective
    lost a peer: torch's DistError family, or a backend error in the words gloo and NCCL use for a
    dead or silent peer. None when there is none."""
    dist_error = _torch().distributed.DistError
    for e in causes(exc):
        if isinstance(e, dist_error) or _is_backend_words(e):
            return e
    return None


def is_peer_loss(exc: BaseException) -> bool:
    return peer_error(exc) is not None


class Heartbeat:
    """This process's beat in `store`, and what the other ranks' beats say."""

    def __init__(self, store, rank: int, world: int, prefix: str = PREFIX, interval: float = BEAT_S) -> None:
        self.store, self.rank, self.world = store, int(rank), int(world)
        self.prefix, self.interval = prefix, float(interval)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: tuple[float, Callable[[list[int], str], None]] | None = None
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last count, when it last moved)

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def start(self) -> Heartbeat:
        if self._thread is None:
            with contextlib.suppress(Exception):  # the first beat before start() returns
                bounded(lambda: self.store.add(self._key(self.rank), 1))
            self._thread = threading.Thread(target=self._run, name="slimckpt-heartbeat", daemon=True)
            self._thread.start()
            _BEATS.add(self)
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        # on this thread itself, unbounded: a store that blocks stops this process's beat, and a
        # helper thread per beat would pile up for as long as it blocks
        try:
            self.store.add(self._key(self.rank), 1)
        except Exception:  # noqa: BLE001 - a store gone at the end of the job: nothing to beat into
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._beat()
            if self._watch is not None:
                self._check_watch()

    def counts(self) -> dict[int, int]:
        """Each other rank's beat count (0: never beat). Raises StoreSilent when the store is gone."""
        out = {}
        for r in range(self.world):
            if r != self.rank:
                out[r] = int(bounded(lambda r=r: self.store.add(self._key(r), 0)))
        return out

    def silent(self, beats: int = 3) -> tuple[list[int], str]:
        """Ranks whose beat did not move over `beats` intervals, and why they are named ("" or a note
        that the store itself stopped answering)."""
        try:
            before = self.counts()
            time.sleep(beats * self.interval)
            after = self.counts()
        except Exception as exc:  # noqa: BLE001 - StoreSilent, or the store's host is gone
            host = "rank 0" if env_vars.foreign("TORCHELASTIC_USE_AGENT_STORE") != "True" else "torchrun's agent"
            return (
                [0] if host == "rank 0" and self.rank != 0 else []
            ), f"the job's store ({host}) stopped answering: {type(exc).__name__}"
        return [r for r in sorted(after) if after[r] == before[r]], ""

    def watch(self, timeout: float, on_silent: Callable[[list[int], str], None]) -> None:
        """From now on, call `on_silent(ranks, note)` (on the heartbeat thread) once some rank's beat
        has not moved for `timeout` seconds."""
        self._seen = {}
        self._watch = (float(timeout), on_silent)

    def _check_watch(self) -> None:
        timeout, on_silent = self._watch
        now = time.monotonic()
        try:
            counts = self.counts()
        except Exception as exc:  # noqa: BLE001
            counts, note = None, f"the job's store stopped answering: {type(exc).__name__}"
        else:
            note = ""
        if counts is None:
            started = self._seen.setdefault(-1, (0, now))[1]
            if now - started > timeout:
                self._watch = None
                on_silent([0] if self.rank != 0 else [], note)
            return
        self._seen.pop(-1, None)
        late = []
        for r, c in counts.items():
            last = self._seen.get(r)
            if last is None or c != last[0]:
                self._seen[r] = (c, now)
            elif now - last[1] > timeout:
                late.append(r)
        if late:
            self._watch = None
            on_silent(late, note)


def describe_ranks(ranks: list[int], world: int) -> str:
    if not ranks:
        return f"a peer of {world} ranks (none found silent: the network, or this rank was the one stopped)"
    names = ", ".join(map(str, ranks))
    return f"rank{'s' if len(ranks) > 1 else ''} {names} of {world}"


def default_group_timeout():
    """The timeout of the job's default process group (verl 0.9.1 on GPU: NCCL's 10 minutes), for
    the groups we create: `new_group` would otherwise give a gloo group torch's 30 minutes, so a stalled
    rank would hold every other rank in our collectives far past the job's own timeout. None when
    torch does not say."""
    torch = _torch()
    get_default_group = internals.lookup("torch.distributed.distributed_c10d:_get_default_group")
    if get_default_group is None:
        return None
    try:
        group = get_default_group()
        for device in ("cuda", "cpu"):  # the accelerator's first: training's collectives time out by it
            try:
                return group._get_backend(torch.device(device)).options._timeout
            except (RuntimeError, AttributeError, ValueError):
                continue
    except Exception:  # noqa: BLE001 - no default group, or its backend has no options: torch's default then
        pass
    return None


# every started beat, and the bounded() threads still inside their call
_BEATS: weakref.WeakSet[Heartbeat] = weakref.WeakSet()
_CALLS: set[threading.Thread] = set()
_LIVE_LOCK = threading.Lock()


def end_store_calls(wait_s: float = EXIT_WAIT_S) -> None:
    """At interpreter exit: stop every beat and give the store calls in flight `wait_s` in all to
    return. A daemon thread that comes back from a store call (C++, the GIL released) into a
    finalizing interpreter is ended by pthread_exit, and that unwinding through pybind11's noexcept
    frames calls std::terminate: the process would abort ("terminate called without an active
    exception") after its work is done. A sleeping beat ends at once; a call still blocked after the
    wait is on a stopped or dead store host and is left alone (a thread that never takes the GIL
    again is harmless), so a lost host delays the exit by `wait_s` at most."""
    deadline = time.monotonic() + wait_s
    beats = list(_BEATS)
    for beat in beats:
        beat.stop()
    with _LIVE_LOCK:
        threads = [b._thread for b in beats if b._thread is not None] + list(_CALLS)
    for thread in threads:
        if thread.is_alive() and thread is not threading.current_thread():  # one that never started cannot be joined
            thread.join(max(0.0, deadline - time.monotonic()))


# registered at import, so that it runs after the exit hooks registered later (atexit runs them last
# first): among them the background writes' finish_all (save.modes.writer imports this module before
# registering it), whose collectives still need this rank's beat so the others can name a lost peer
atexit.register(end_store_calls)

_PROCESS: list[Heartbeat] = []
_LOCK = threading.Lock()


class LostRanks:
    """What this process found lost, each part kept from its first finding: the ranks whose beat
    stopped (and the note that came with them), and the line a save of this process reported."""

    def __init__(self) -> None:
        self.silent: tuple[list[int], str] | None = None
        self.line: str | None = None

    def name(self, ranks: list[int], note: str) -> tuple[list[int], str]:
        """The silent ranks: the first named, whatever a later look finds."""
        if self.silent is None and ranks:
            self.silent = (ranks, note)
        return self.silent or (ranks, note)

    def remember(self, line: str) -> None:
        """The loss a save reported (lost_ranks_line's words), for the saves after it."""
        if self.line is None:
            self.line = line


LOST = LostRanks()


def in_a_job() -> bool:
    """Whether this process is one rank of a default process group of several: the only case where
    a peer can be lost."""
    dist = _torch().distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def process_heartbeat() -> Heartbeat | None:
    """This process's heartbeat in the default process group's store (started on first use), or
    None without a multi-rank group or a store to beat into."""
    dist = _torch().distributed
    if not in_a_job():
        return None
    with _LOCK:
        if not _PROCESS:
            get_default_store = internals.lookup("torch.distributed.distributed_c10d:_get_default_store")
            if get_default_store is None:
                return None
            try:
                store = dist.PrefixStore(PREFIX, get_default_store())
            except Exception:  # noqa: BLE001 - no store to beat into: the errors just do not name ranks
                return None
            _PROCESS.append(Heartbeat(store, dist.get_rank(), dist.get_world_size(), prefix="beat").start())
        return _PROCESS[0]


def _short(text: str) -> str:
    """The backend's first sentence, without its source location ("[.../pair.cc:553] ")."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = re.sub(r"^\[[^\]]*\]\s*", "", line)
    return line.split(". ")[0].rstrip(".")[:160]


def lost_ranks_line(exc: BaseException, beat: Heartbeat | None = None) -> str | None:
    """For a collective that lost a peer: 'rank 1 of 3 stopped answering (...)'; None otherwise.
    `beat`: the heartbeat to ask (default: this process's, in the default group's store)."""
    error = peer_error(exc)
    if error is None:
        return None
    beat = beat or process_heartbeat()
    cause = _short(str(error)) or type(error).__name__
    if beat is None:
        return f"a peer rank stopped answering ({cause})"
    # the ranks named once: the group is broken, every later failure is the same loss
    ranks, note = LOST.silent if LOST.silent is not None else LOST.name(*beat.silent())
    return (
        f"{describe_ranks(ranks, beat.world)} stopped answering: killed, or stalled past the process group's "
        f"timeout ({note or cause}; this is rank {beat.rank})"
    )


__all__ = [
    "LOST",
    "Heartbeat",
    "LostRanks",
    "StoreSilent",
    "bounded",
    "causes",
    "default_group_timeout",
    "describe_ranks",
    "end_store_calls",
    "in_a_job",
    "is_peer_loss",
    "lost_ranks_line",
    "peer_error",
    "process_heartbeat",
]
