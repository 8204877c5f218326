"""The fault campaigns' children: a forked body that dies with the campaign and logs to its trial dir, waiting for a
group of them (killing what outlives its timeout), their event logs read whole or followed as they grow, and a
fresh trial dir; the rank campaign's view of processes: orphans reaped (this process their subreaper), slimckpt's
lock files still held, ranks ended by a deadline or killed after a stack dump, the lost rank a log names.
scripts/faults/reliability.py and ranks.py fork their savers and checkers through these."""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import shutil
import signal
import sys
import time

from scripts.faults import oracle
from scripts.faults import trial as fault_trial

# a lost rank named in a log: ours (the heartbeat's line) or torchrun's failure summary
NAMED = re.compile(r"rank (\d+) of (\d+) stopped answering|rank\s*: (\d+) \(local_rank")


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


def become_subreaper() -> None:
    """Orphans of the trials' processes are re-parented here, so none can hide."""
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def proc_children(parent: int):
    """(pid, state) of each process whose parent is `parent`, from /proc."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == parent:
            yield int(name), fields[0]


def children() -> dict[int, str]:
    """pid -> command of every live child of this process (zombies reaped)."""
    out = {}
    for pid, state in proc_children(os.getpid()):
        try:
            if state == "Z":
                os.waitpid(pid, os.WNOHANG)
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except (OSError, ChildProcessError):
            continue
    return out


def reap_orphans(known: set[int]) -> list[str]:
    """Kill and reap children that are not the trial's own processes; their commands."""
    found = []
    for pid, cmd in children().items():
        if pid in known:
            continue
        found.append(cmd or str(pid))
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (OSError, ChildProcessError):
            pass
    return found


def held_locks(root: str) -> list[str]:
    """slimckpt lock files under `root` that someone still holds."""
    held = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(".slimckpt-lock"):
                path = os.path.join(dirpath, name)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    held.append(os.path.relpath(path, root))
                finally:
                    os.close(fd)
    return held


def wait_until(pids: list[int], deadline: float) -> dict[int, float | None]:
    """pid -> when it ended (None: still running at `deadline`)."""
    ended: dict[int, float | None] = {}
    while len(ended) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid in ended:
                continue
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                ended[pid] = time.monotonic()
        time.sleep(0.01)
    return {pid: ended.get(pid) for pid in pids}


def end(pids: list[int]) -> None:
    """Stack dumps (faulthandler, SIGUSR1) into the logs of forked ranks, then SIGKILL and reap."""
    for pid in pids:
        with_signal(pid, signal.SIGUSR1)
    time.sleep(1.0)
    for pid in pids:
        with_signal(pid, signal.SIGCONT)
        with_signal(pid, signal.SIGKILL)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def with_signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def named_ranks(paths: list[str]) -> set[int]:
    """Ranks that a line of these logs names as lost (ours, or torchrun's failure summary)."""
    found: set[int] = set()
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path, errors="replace") as f:
            for m in NAMED.finditer(f.read()):
                found.add(int(m.group(1) if m.group(1) is not None else m.group(3)))
    return found


def proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2 :].split()[0]
    except OSError:
        return None
