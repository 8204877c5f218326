"""Run a command and measure it from outside: wall time and the peak anonymous RSS of every
process in its tree (torchrun's ranks each get their own peak). Used by benchmarks, where a
sampler inside the measured process would both perturb it and miss what its children do."""

from __future__ import annotations

import os
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field

from slimckpt import env_vars
from slimckpt.observe.memory import TreePeaks, sample_tree_peaks
from slimckpt.storage import for_path


@dataclass
class RunResult:
    cmd: list[str]
    returncode: int
    wall_s: float
    peaks: dict[int, int] = field(default_factory=dict)
    output: str = ""
    shared_peak: int = 0  # TreePeaks.shared: summed Pss_Anon while the tree had several processes

    @property
    def max_peak(self) -> int:
        """Largest peak of any single process of the tree (per-rank peak for torchrun)."""
        return max(self.peaks.values(), default=0)

    @property
    def physical_peak(self) -> int:
        """Anonymous memory the whole tree held at its peak, shared pages counted once (TreePeaks.physical)."""
        return TreePeaks(self.peaks, self.shared_peak).physical

    @property
    def total_peak(self) -> int:
        """Sum of per-process peaks: an upper bound of the tree's simultaneous anonymous memory."""
        return sum(self.peaks.values())


def run_measured(
    cmd: list[str],
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    interval_s: float = 0.01,
    timeout_s: float | None = None,
) -> RunResult:
    full_env = {**env_vars.environment(), **(env or {})}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=full_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found = TreePeaks({})
    stop = threading.Event()

    def sampler() -> None:
        nonlocal found
        found = sample_tree_peaks(proc.pid, interval_s=interval_s, stop=stop)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    wall = time.perf_counter() - start
    stop.set()
    thread.join()
    return RunResult(
        cmd=cmd,
        returncode=proc.returncode,
        wall_s=wall,
        peaks=found.per_process,
        output=output or "",
        shared_peak=found.shared,
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def evict_from_page_cache(paths: list[str]) -> None:
    """Ask the kernel to drop cached pages of these files, so a run reads them from disk."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            for_path(path).sync_open(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
