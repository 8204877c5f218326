"""Stress runs that repeat one operation many times under shaken timing and a loaded CPU (`make stress-merge`,
`make stress-flaky`)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def cpu_load(on: bool = True) -> Iterator[None]:
    """A second process that keeps one core busy while the block runs (nothing when `on` is off)."""
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        yield
    finally:
        if load is not None:
            load.kill()
            load.wait()
