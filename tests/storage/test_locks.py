"""storage/locks: two writers on one target, the first holds and the second fails fast naming the holder and the
fix; readers share; a killed holder never blocks; the lock file sits beside the directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from slimckpt.storage import locks


def test_second_writer_fails_fast_naming_target_holder_and_fix(tmp_path):
    target = str(tmp_path / "out")
    with locks.writing(target, "merging a into it", fix="choose another --target_dir"):
        with pytest.raises(locks.LockBusy) as err:
            locks.acquire(target, exclusive=True, what="x", fix="choose another --target_dir")
    msg = str(err.value)
    assert "\n" not in msg and target in msg and f"pid {os.getpid()}" in msg and "merging a into it" in msg
    assert msg.endswith("choose another --target_dir")
    assert not os.path.exists(locks.lock_file_for(target))  # released: the file goes with it


def test_readers_share_and_exclude_writers(tmp_path):
    d = str(tmp_path / "step")
    with locks.reading(d, "merging it"), locks.reading(d, "loading it"):
        assert locks.try_exclusive(d, "deleting it") is None
        with pytest.raises(locks.LockBusy, match="loading it|merging it"):
            locks.acquire(d, exclusive=True, what="saving", fix="fix")
    lock = locks.try_exclusive(d, "deleting it")
    assert lock is not None
    with pytest.raises(locks.LockBusy, match="deleting it"):
        locks.acquire(d, exclusive=False, what="reading", fix="retry")
    lock.release()
    assert not os.path.exists(locks.lock_file_for(d))


def test_a_killed_holder_never_blocks(tmp_path):
    target = str(tmp_path / "out")
    code = (
        "import sys, time; from slimckpt.storage import locks\n"
        "l = locks.acquire(sys.argv[1], exclusive=True, what='writing', fix='')\n"
        # far longer than the checks below (milliseconds): the holder still holds its lock when killed
        "print('held', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, target], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(locks.LockBusy, match=f"pid {proc.pid}"):
            locks.acquire(target, exclusive=True, what="x", fix="y")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert os.path.exists(locks.lock_file_for(target))  # the killed holder left its file behind...
    with locks.writing(target, "x", fix="y"):  # ...which does not block
        pass


def test_lock_file_outside_the_directory(tmp_path):
    d = tmp_path / "global_step_3" / "actor"
    assert locks.lock_file_for(str(d)) == str(tmp_path / "global_step_3" / ".actor.slimckpt-lock")
