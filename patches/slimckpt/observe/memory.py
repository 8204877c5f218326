"""Host memory as we report it: anonymous RSS (`RssAnon` in /proc/<pid>/status), sampled.

Anonymous RSS is what a save or merge really costs a host: pages read through mmap are file
backed, the kernel can drop them, and they are not what kills jobs with the OOM killer.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import psutil


def rss_anon_bytes(pid: int | str = "self") -> int:
    """RssAnon of a process in bytes; 0 when the process is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return 0
    return 0


@dataclass
class RssPeak:
    baseline: int = 0
    peak: int = 0
    samples: int = 0

    @property
    def extra(self) -> int:
        """Peak above what the process held when sampling started."""
        return max(0, self.peak - self.baseline)


class RssSampler:
    """Samples one process's RssAnon on a background thread (default: this process).

    Used as a context manager around a save; `result` holds baseline and peak. A thread can miss
    a spike shorter than its interval while C code holds the GIL, so benchmarks sample from a
    separate process (`scripts/bench/merge.py`); plateaus, which is what checkpoint buffers are, are seen.
    """

    def __init__(self, pid: int | str = "self", interval_s: float = 0.005) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.result = RssPeak()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        value = rss_anon_bytes(self.pid)
        self.result.samples += 1
        if value > self.result.peak:
            self.result.peak = value

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> RssSampler:
        self.result = RssPeak(baseline=rss_anon_bytes(self.pid))
        self.result.peak = self.result.baseline
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="slimckpt-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()


def pss_anon_bytes(pid: int | str = "self") -> int:
    """Pss_Anon of a process in bytes (anonymous pages, each shared one divided among its sharers);
    0 when the process is gone. Costs a walk of its page tables (about 2 ms for a process with
    torch and transformers loaded), so it is sampled less often than RssAnon."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss_Anon:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    return 0


@dataclass
class TreePeaks:
    """Peaks of a process tree. `per_process`: {pid: peak RssAnon}. `shared`: while the tree had
    more than one process, the peak of the sum of their Pss_Anon; 0 if it never had. A forked
    child's RssAnon counts every page it shares with its parent, so summing RssAnon counts those
    pages twice; summed Pss_Anon counts each page once, which is what the host really holds."""

    per_process: dict[int, int]
    shared: int = 0

    @property
    def physical(self) -> int:
        """Anonymous memory the whole tree held at its peak: the larger of the biggest single process
        and the summed Pss_Anon."""
        return max(max(self.per_process.values(), default=0), self.shared)


def sample_tree(root_pid: int, interval_s: float = 0.01, stop: threading.Event | None = None) -> dict[int, int]:
    """Peak RssAnon of `root_pid` and each of its descendants until they all exit (or `stop`).

    Returns {pid: peak bytes}. Used by benchmarks to measure torchrun ranks from outside.
    """
    return sample_tree_peaks(root_pid, interval_s, stop).per_process


def sample_tree_peaks(
    root_pid: int, interval_s: float = 0.01, stop: threading.Event | None = None, pss_interval_s: float = 0.05
) -> TreePeaks:
    """`sample_tree`, plus the summed Pss_Anon of the tree whenever it has several processes."""
    peaks: dict[int, int] = {}
    shared = 0
    next_pss = 0.0
    try:
        root = psutil.Process(root_pid)
    except psutil.NoSuchProcess:
        return TreePeaks(peaks)
    while not (stop is not None and stop.is_set()):
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for proc in procs:
            value = rss_anon_bytes(proc.pid)
            if value > peaks.get(proc.pid, 0):
                peaks[proc.pid] = value
        if len(procs) > 1 and time.perf_counter() >= next_pss:
            shared = max(shared, sum(pss_anon_bytes(p.pid) for p in procs))
            next_pss = time.perf_counter() + pss_interval_s
        try:
            if not root.is_running() or root.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:  # exited (and was reaped) between the two questions
            break
        time.sleep(interval_s)
    return TreePeaks(peaks, shared)


def now() -> float:
    return time.perf_counter()


def gib(n: int | float) -> float:
    return n / 2**30


def mib(n: int | float) -> float:
    return n / 2**20


def dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total
