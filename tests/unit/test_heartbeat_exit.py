"""A process whose heartbeat is inside a store call when the interpreter exits must exit cleanly.

The beat thread is a daemon that calls the store (C++, GIL released). If such a call returns into a
finalizing interpreter, Python ends the thread with pthread_exit, and the unwinding through
pybind11's noexcept frames aborts the whole process after its work is done ("terminate called
without an active exception", exit -6). The store here makes every beat a 20 ms C++ wait, so the
thread is almost always inside one; the control run, without the exit hook, shows the abort is real.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, datetime, sys, time
    import torch.distributed as dist
    from slimckpt.write import peers

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))

    class SlowStore:
        def add(self, key, n):
            try:
                store.wait(["never-set"], datetime.timedelta(milliseconds=20))
            except Exception:
                pass
            return 0

    beat = peers.Heartbeat(SlowStore(), 0, 1, interval=0.0005).start()
    peers._PROCESS.append(beat)  # what process_heartbeat() does with the job's store
    if sys.argv[1] == "without-hook":
        atexit.unregister(peers.stop_process_heartbeat)
    time.sleep(0.2)
    """
)


def _exits(mode: str, runs: int) -> list[int]:
    return [
        subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, timeout=120).returncode
        for _ in range(runs)
    ]


@pytest.mark.slow
def test_a_beat_inside_a_store_call_at_exit_does_not_abort_the_process():
    assert _exits("with-hook", 6) == [0] * 6


@pytest.mark.slow
def test_without_the_exit_hook_the_same_process_aborts():
    # the control: the scenario above does reach the abort when the beat is left running
    assert any(rc != 0 for rc in _exits("without-hook", 6))
