"""Run one function in a forked child process and get back its result or its exception.

The merge's early writer uses it so the write pipeline (read, cast, write threads) and the imports
of transformers and verl (seconds of Python in the parent) stop taking turns on one GIL. A fork
costs no new import of torch and no second copy of memory: the child shares the parent's pages
until either writes them, and the pipeline's buffers are allocated in the child.

Forking is only safe in a process with one thread (a lock held by another thread at the fork
stays locked in the child forever), so `possible()` says no otherwise and callers use a thread.
The child dies with its parent (PR_SET_PDEATHSIG), ignores Ctrl-C (the parent decides and kills
it), and leaves with os._exit: it never runs the parent's cleanup (atexit, finally blocks, lock
releases).
"""

from __future__ import annotations

import ctypes
import gc
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from .. import env_vars

PR_SET_PDEATHSIG = 1


def possible() -> bool:
    """Whether fork is available and safe here (Linux, this thread alone, not disabled)."""
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "fork")
        and threading.active_count() == 1
        and env_vars.flag("SLIMCKPT_MERGE_FORK")
    )


class ChildDied(RuntimeError):
    """The child ended without a result (killed, out of memory, crashed in C code)."""


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` dies (exit at once if it already has)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # no prctl: the child still finishes its writes and exits on its own
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _payload(outcome: tuple[str, Any]) -> bytes:
    try:
        return pickle.dumps(outcome)
    except Exception:  # noqa: BLE001 - an exception or result that cannot be pickled
        kind, value = outcome
        text = f"{type(value).__name__}: {value}" if kind == "error" else "result could not be sent back"
        return pickle.dumps(("error", RuntimeError(text)))


class ForkedCall:
    """`fn(*args)` in a forked child, started now; `join()` returns its result or raises its exception."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str = "slimckpt child") -> None:
        self.name = name
        parent = os.getpid()
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()  # else buffered text would be printed by both processes
        # A collection walks every tracked object and writes to its header, which copies each page it
        # touches in whichever process collects: frozen objects are never walked again.
        gc.freeze()
        try:
            pid = os.fork()
        except OSError:
            os.close(read_end)
            os.close(write_end)
            raise
        if pid == 0:  # the child: never returns
            code = 0
            try:
                os.close(read_end)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                die_with_parent(parent)
                try:
                    outcome: tuple[str, Any] = ("ok", fn(*args))
                except BaseException as exc:  # noqa: BLE001 - sent to the parent
                    outcome = ("error", exc)
                data = memoryview(_payload(outcome))
                while len(data):
                    data = data[os.write(write_end, data) :]
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException:  # noqa: BLE001 - nothing may escape into the parent's code
                code = 1
            finally:
                os._exit(code)
        os.close(write_end)
        self.pid: int | None = pid
        self._read_end: int | None = read_end

    def join(self) -> Any:
        """Wait for the child; its result, or its exception raised here."""
        chunks = []
        pid = self.pid
        assert self._read_end is not None, "joined twice"
        try:
            while True:
                chunk = os.read(self._read_end, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(self._read_end)
            self._read_end = None
            status = self._wait()
        if not chunks:
            raise ChildDied(f"the {self.name} (pid {pid}) ended without a result ({_describe(status)})")
        kind, value = pickle.loads(b"".join(chunks))
        if kind == "error":
            raise value
        return value

    def kill(self) -> None:
        """Stop the child now and reap it (its output is being discarded)."""
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self._read_end is not None:
            os.close(self._read_end)
            self._read_end = None
        self._wait()

    def _wait(self) -> int:
        if self.pid is None:
            return 0
        while True:
            try:
                _, status = os.waitpid(self.pid, 0)
                break
            except InterruptedError:
                continue
            except ChildProcessError:
                status = 0
                break
        self.pid = None
        return status


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        hint = "; out of memory?" if sig == signal.SIGKILL else ""
        return f"killed by signal {signal.Signals(sig).name}{hint}"
    if os.WIFEXITED(status):
        return f"exit code {os.WEXITSTATUS(status)}"
    return f"status {status}"
