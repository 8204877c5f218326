"""A bench worker's view of its own anonymous memory over a window: a sampler process beside the worker reads its
RssAnon every 5 ms, and the worker opens and closes windows (WindowSampler.start / stop). save.py's hidden
--sample-pid runs sampler_main; the save benches (save, train_scale, s3_save) use WindowSampler."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

# lazy imports: slimckpt's memory reader loads in the sampler process only

REPO = Path(__file__).resolve().parents[2]
SAMPLE_INTERVAL_S = 0.005


def sampler_main(pid: int) -> int:
    """Sample RssAnon of `pid` until stdin closes. Commands on stdin: `start` opens a window
    (prints the level now), `stop` closes it (prints the window's peak)."""
    from slimckpt.observe.memory import rss_anon_bytes

    peak, active = 0, False
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], SAMPLE_INTERVAL_S)
        if active:
            peak = max(peak, rss_anon_bytes(pid))
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            return 0
        now = rss_anon_bytes(pid)
        if line.strip() == "start":
            peak, active = now, True
            print(now, flush=True)
        elif line.strip() == "stop":
            active = False
            print(max(peak, now), flush=True)


class WindowSampler:
    """The worker's handle on its sampler process."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scripts.bench.save", "--sample-pid", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )

    def _ask(self, command: str) -> int:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the RSS sampler process exited (code {self.proc.poll()})")
        return int(line)

    def start(self) -> int:
        return self._ask("start")

    def stop(self) -> int:
        return self._ask("stop")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
