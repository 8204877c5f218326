"""async_save's modes (slimckpt.save.modes): one registry whose names are the config's, each
mode's stage / wait_until_safe_to_step / finish as the save calls them, and a fourth mode added by
registering a class."""

from __future__ import annotations

import functools
import threading
from types import SimpleNamespace
from typing import get_args

import pytest
import torch

from slimckpt.options.checkpoint_options import ASYNC_WORDS, AsyncSave
from slimckpt.plan import cost
from slimckpt.save import step_write
from slimckpt.save.modes import base, registry
from slimckpt.save.modes.pool import PoolMode
from slimckpt.save.modes.stream import StreamMode
from slimckpt.save.modes.sync import SyncMode
from slimckpt.save.modes.writer import AsyncResumeWriter
from slimckpt.save.save_context import SaveContext
from slimckpt.verl.checkpoint_config import SlimCheckpointConfig


def test_the_registry_names_exactly_the_configs_modes_and_the_plan_costs_each():
    names = set(get_args(AsyncSave))
    assert set(registry.MODES) == names
    assert set(ASYNC_WORDS.values()) == names  # every YAML spelling lands on a mode
    assert set(cost.ASYNC_STRATEGY) == names  # slimckpt plan models every mode, and no other
    for name, mode in registry.MODES.items():
        assert issubclass(mode, base.AsyncMode) and mode.name == name


@pytest.mark.parametrize(
    ("word", "mode"), [("false", SyncMode), ("true", PoolMode), ("pool", PoolMode), ("stream", StreamMode)]
)
def test_a_checked_config_picks_its_mode(word, mode):
    config = SlimCheckpointConfig(recipe="incremental", incremental_save=word != "false", async_save=word)
    assert type(registry.mode_for(config)) is mode


def _ctx(step: int = 7, manager=None, config=None) -> SaveContext:
    return SaveContext(manager, f"/nowhere/global_step_{step}/actor", step, None, config, ["model"])


class RecordingWriter:
    """The writer's two calls a mode makes, recorded; `stage` answers `staged`."""

    def __init__(self, staged=None) -> None:
        self.staged, self.calls = staged, []

    def stage(self, state, config, step, group=None):
        self.calls.append(("stage", step))
        return self.staged

    def submit(self, step, path, write, mode, arm=None, capture=None):
        self.calls.append(("submit", step, path, mode))
        self.write, self.arm, self.capture = write, arm, capture


def test_sync_writes_now_from_the_live_state(monkeypatch):
    written = []
    monkeypatch.setattr(step_write, "write_and_commit", lambda ctx, state: written.append((ctx, state)))
    ctx, state, writer = _ctx(), {"model": {}}, RecordingWriter()
    staged = SyncMode().stage(ctx, state, writer)
    assert staged.phase is None and staged.state is state
    SyncMode().finish(staged, writer)
    assert written == [(ctx, state)] and writer.calls == []


def test_pool_over_its_budget_saves_as_sync_does(monkeypatch):
    written = []
    monkeypatch.setattr(step_write, "write_and_commit", lambda ctx, state: written.append(state))
    ctx, state, writer = _ctx(), {"model": {}}, RecordingWriter(staged=None)
    staged = PoolMode().stage(ctx, state, writer)
    assert staged.phase is None  # no "stage" or "blocking" timing: the save blocked for the write
    PoolMode().finish(staged, writer)
    assert written == [state] and writer.calls == [("stage", 7)]


def test_pool_hands_the_staged_copy_to_the_writer(monkeypatch):
    copy = {"model": {"w": torch.zeros(2)}}
    ctx, writer = _ctx(), RecordingWriter(staged=copy)
    staged = PoolMode().stage(ctx, {"model": {"w": torch.ones(2)}}, writer)
    assert staged.phase == "stage" and staged.state is copy
    PoolMode().finish(staged, writer)
    assert writer.calls == [("stage", 7), ("submit", 7, ctx.local_path, "pool")]
    assert writer.write.args == (ctx, copy) and writer.capture is None
    assert writer.arm() is base.NO_GUARD  # the copy is its own: nothing to guard


def test_stream_guards_the_optimizer_step_until_the_write_ends(monkeypatch):
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    manager = SimpleNamespace(model=None, optimizer=optimizer)
    ctx = _ctx(manager=manager, config=SimpleNamespace(host_memory_budget_gb=1.0))
    go, seen = threading.Event(), {}

    def write(ctx, state):  # the writer's thread: the capture is the context's, the guard armed
        seen["capture"], seen["state"] = ctx.capture, state
        go.wait(5)

    monkeypatch.setattr(step_write, "write_and_commit", write)
    writer = AsyncResumeWriter()
    mode = StreamMode()
    staged = mode.stage(ctx, {"model": {"w": param}}, writer)
    assert staged.phase == "capture" and staged.state is staged.capture.state
    mode.finish(staged, writer)
    assert writer.mode == "stream" and writer.capture is staged.capture
    assert optimizer._optimizer_step_pre_hooks  # the guard, armed at the hand-off
    go.set()
    writer.wait()
    assert seen["capture"] is staged.capture and seen["state"]["model"]["w"] is param
    assert staged.capture.closed  # the write ended: nothing waits for it
    assert not optimizer._optimizer_step_pre_hooks  # removed on this thread, at the wait


class FakeMode(base.AsyncMode):
    """A fourth mode, as one file would add it: the write runs on the writer's thread from a list."""

    name = "fake"
    events: list[str] = []

    def stage(self, ctx, state, writer):
        self.events.append("stage")
        return base.Staged(ctx, {"copied": list(state)}, phase="fake_stage")

    def wait_until_safe_to_step(self, staged):
        self.events.append("arm")
        return base.Guard(
            remove_hooks=lambda: self.events.append(f"remove on {threading.current_thread().name}"),
            write_ended=lambda: self.events.append("ended"),
        )

    def finish(self, staged, writer):
        writer.submit(
            staged.ctx.step,
            staged.ctx.local_path,
            lambda: self.events.append(f"write {staged.state['copied']}"),
            self.name,
            arm=functools.partial(self.wait_until_safe_to_step, staged),
        )


def test_a_fourth_mode_registered_is_chosen_by_name_and_run_in_order(monkeypatch):
    monkeypatch.setitem(registry.MODES, FakeMode.name, FakeMode)
    monkeypatch.setattr(FakeMode, "events", [])
    mode = registry.mode_for(SimpleNamespace(async_save="fake"))
    assert isinstance(mode, FakeMode) and isinstance(registry.mode_named("fake"), FakeMode)
    writer = AsyncResumeWriter()
    staged = mode.stage(_ctx(), {"model": 1, "optimizer": 2}, writer)
    mode.finish(staged, writer)
    writer.wait()
    main = threading.current_thread().name
    assert FakeMode.events == ["stage", "arm", "write ['model', 'optimizer']", "ended", f"remove on {main}"]


def test_a_saves_writer_lock_waits_for_the_background_write_of_every_mode_but_sync():
    assert {name: cls.background for name, cls in registry.MODES.items()} == {
        "off": False,
        "pool": True,
        "stream": True,
    }
