"""Checkpoint commits in flight in this process, so that a reader in the same job waits for them.

An async save returns before its step is committed: its write and commit run on a background
thread (slimckpt.save.modes.writer), and the commit is collective (rank 0 writes the manifest
once every rank has reported its files, then tells every rank the outcome). A load, a
`verify_path` or a `merge` of that step in this process, started meanwhile, would otherwise see
a step without its manifest and refuse it (or see it on one rank and not on another). Each write
registers the role dir it writes here until its commit has ended, committed or failed; `wait_for`
blocks until every write of a dir at, under or above a path has ended. It does not raise: what
the reader finds on disk afterwards is the outcome (a manifest, or a failure marker and none).

Only this process's writes are known: another process sees an uncommitted step as it is, refused.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

_LOCK = threading.Lock()
_WRITES: list[Write] = []


@dataclass(eq=False)
class Write:
    """One background write of a role dir; `done` is set once its commit has ended."""

    path: str
    done: threading.Event = field(default_factory=threading.Event)
    thread: int | None = None  # the writer thread, once it runs (it never waits for itself)


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep)


def begin(path: str) -> Write:
    """Register a write of `path` (the role dir); call `end` once its commit has ended."""
    write = Write(os.path.abspath(path))
    with _LOCK:
        _WRITES.append(write)
    return write


def running(write: Write) -> None:
    """Called on the writer thread as the write starts: a wait from that thread skips it."""
    write.thread = threading.get_ident()


def end(write: Write) -> None:
    """The commit of `write` has ended (committed or failed); idempotent."""
    with _LOCK:
        if write in _WRITES:
            _WRITES.remove(write)
    write.done.set()


def wait_for(path: str | None) -> list[str]:
    """Block until no write at, under or above `path` is in flight in this process (a write's
    own thread never waits for itself); the role dirs waited for."""
    if not path:
        return []
    path, me = os.path.abspath(path), threading.get_ident()
    with _LOCK:
        writes = [w for w in _WRITES if _related(w.path, path) and w.thread != me]
    for write in writes:
        write.done.wait()
    return [w.path for w in writes]


__all__ = ["Write", "begin", "end", "running", "wait_for"]
