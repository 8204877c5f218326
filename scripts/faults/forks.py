"""The fault campaigns' children: a forked body that dies with the campaign and logs to its trial dir, waiting for a
group of them (killing what outlives its timeout), their event logs read whole or followed as they grow, and a
fresh trial dir. scripts/faults/reliability.py and ranks.py fork their savers and checkers through these."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import time

from scripts.faults import oracle
from scripts.faults import trial as fault_trial


def _die_with_parent() -> None:
    """A child SIGKILLed when the campaign dies (else a rank waits in a collective forever)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def fork(body, *args, log: str | None = None) -> int:
    """A child running `body(*args)`; its stdout/stderr go to `log` (verl prints a lot)."""

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _die_with_parent()
        if log is not None:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        fault_trial.run_child(body, *args)
    return pid


def wait_all(pids: list[int], timeout: float) -> tuple[list[int | None], bool]:
    """Exit codes (None: killed by a signal); kills everything left after `timeout`."""
    deadline = time.monotonic() + timeout
    codes: dict[int, int | None] = {}
    hung = False
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else None
        if len(codes) < len(pids):
            if time.monotonic() > deadline:
                hung = True
                for pid in pids:  # every thread's stack into the child's log first (faulthandler)
                    if pid not in codes:
                        os.kill(pid, signal.SIGUSR1)
                time.sleep(1.0)
                for pid in pids:
                    if pid not in codes:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        codes[pid] = None
            time.sleep(0.005)
    return [codes[p] for p in pids], hung


def read_events(trial_dir: str) -> dict[int, list[oracle.Event]]:
    out = {}
    for rank in range(2):
        path = os.path.join(trial_dir, f"events_rank_{rank}.log")
        with open(path) if os.path.exists(path) else open(os.devnull) as f:
            out[rank] = oracle.parse_events(f.read())
    return out


def child_error(trial_dir: str) -> str | None:
    """The last exception line a child logged."""
    for name in sorted(os.listdir(trial_dir)):
        if name.endswith(".log") and not name.startswith("events"):
            with open(os.path.join(trial_dir, name), errors="replace") as f:
                lines = [
                    ln.strip() for ln in f if ln.strip() and not ln.startswith(" ") and ("Error" in ln or "error" in ln)
                ]
            if lines:
                return lines[-1][:300]
    return None


class Tail:
    """Rank 0's event log read incrementally (the parent polls it every millisecond)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.buf = b""

    def events(self) -> list[oracle.Event]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        self.buf += data
        complete, _, self.buf = self.buf.rpartition(b"\n")
        return oracle.parse_events(complete.decode(errors="replace")) if complete else []


def wait_save_begin(trial_dir: str, pids: list[int], step: int, timeout: float = 120.0) -> float:
    """Wait until rank 0 begins the save of `step`; returns that moment (its event's time)."""
    tail = Tail(os.path.join(trial_dir, "events_rank_0.log"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in tail.events():
            if ev.kind == "save-begin" and ev.step == step:
                return ev.t
        for pid in pids:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                raise RuntimeError(f"a saver exited before the save of step {step}; see {trial_dir}")
        time.sleep(0.001)
    raise RuntimeError(f"no save of step {step} after {timeout:.0f} s ({trial_dir})")


def fresh_dir(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path
