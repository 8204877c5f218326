"""forked_call: the merge's early writer runs in a forked child and hands back checksums or errors."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from slimckpt.write import forked_call
from slimckpt.write.forked_call import ChildDied, ForkedCall


class UserFacing(RuntimeError):
    pass


def _pid_and_args(*args):
    return os.getpid(), args


def _raise(msg):
    raise UserFacing(msg)


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _unpicklable():
    return threading.Lock()


def _write_then_sleep(path, seconds):
    def put(text):  # renamed into place: the marker never exists empty (the parent polls for it)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)

    put("started")
    time.sleep(seconds)
    put("finished")


def test_result_comes_back_from_another_process():
    pid, args = ForkedCall(_pid_and_args, 1, {"a": [2]}).join()
    assert pid != os.getpid()
    assert args == (1, {"a": [2]})


def test_exception_is_raised_in_the_parent_with_its_type_and_message():
    with pytest.raises(UserFacing, match="disk full at /x"):
        ForkedCall(_raise, "disk full at /x").join()


def test_a_child_killed_without_a_result_is_an_error_naming_the_signal():
    with pytest.raises(ChildDied, match="SIGKILL"):
        ForkedCall(_die, name="test writer").join()


def test_an_unpicklable_result_becomes_an_error_not_a_hang():
    with pytest.raises(RuntimeError, match="could not be sent back"):
        ForkedCall(_unpicklable).join()


def test_kill_stops_the_child_before_it_finishes(tmp_path):
    marker = tmp_path / "m"
    call = ForkedCall(_write_then_sleep, str(marker), 30.0)
    deadline = time.monotonic() + 10
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    call.kill()
    assert time.monotonic() - start < 5
    assert marker.read_text() == "started"
    call.kill()  # twice is harmless


def test_not_possible_with_other_threads_or_when_disabled(monkeypatch):
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert not forked_call.possible()
    finally:
        stop.set()
        t.join()
    monkeypatch.setenv("SLIMCKPT_MERGE_FORK", "0")
    assert not forked_call.possible()
