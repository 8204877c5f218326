"""async_save=stream: the capture's read/guard protocol on plain tensors (in process), and the real thing through
verl's FSDPCheckpointManager at 2 ranks (slimckpt_testing/scenarios/stream.py in the ws2 batch), planned by
save/modes/stream_planner."""

from __future__ import annotations

import threading

import pytest
import torch

from slimckpt.save.modes import stream_capture
from slimckpt.save.modes.stream_capture import StreamCapture

from ..conftest import scenario_result


def _capture(budget: int, *tensors: torch.Tensor) -> tuple[StreamCapture, list[tuple]]:
    state = {"model": {f"w{i}": t for i, t in enumerate(tensors)}, "optim": {"param_groups": [{"lr": 0.1}]}}
    capture = StreamCapture(state, budget, step=5)
    keys = [capture.key_of(t) for t in tensors]
    capture.plan_reads("dcp", keys)
    capture.start()
    return capture, keys


def _read(capture: StreamCapture, key: tuple, live: torch.Tensor) -> torch.Tensor:
    t, was_live = capture.begin(key, live)
    out = t.clone()
    capture.end(key, was_live)
    return out


def test_capture_copies_small_state_and_keeps_tensors_by_reference():
    w = torch.arange(6.0)
    capture, _ = _capture(0, w)
    capture.state["optim"]["param_groups"][0]["lr"] = 9.9  # the copy, not the optimizer's own
    assert capture.state["model"]["w0"] is w and capture.nbytes == w.numel() * 4


def test_guard_copies_what_is_unread_within_the_budget_and_the_write_keeps_the_saved_values():
    a, b, c = torch.arange(4.0), torch.arange(8.0), torch.ones(3)
    capture, keys = _capture(10**6, a, b, c)
    first = _read(capture, keys[0], a)
    assert capture.guard("the optimizer step") >= 0 and capture.copied_bytes == (8 + 3) * 4
    b.add_(1.0)  # the step may now change them: the writer reads the copies
    c.mul_(3.0)
    assert torch.equal(_read(capture, keys[1], b), torch.arange(8.0))
    assert torch.equal(_read(capture, keys[2], c), torch.ones(3))
    assert torch.equal(first, torch.arange(4.0)) and capture.failure is None
    assert capture.guard("the next step") == 0.0 and capture.guards == 1  # nothing live left


def test_guard_over_budget_waits_until_the_writer_has_read_the_rest():
    a, b = torch.arange(4.0), torch.arange(8.0)
    capture, keys = _capture(4 * 4, a, b)  # room for a only
    entered, done = threading.Event(), threading.Event()

    def guarded_step() -> None:
        entered.set()
        capture.guard("the optimizer step")
        b.add_(1.0)
        done.set()

    step = threading.Thread(target=guarded_step)
    step.start()
    # the step thread starts in milliseconds; 5 s is a hang
    entered.wait(5)
    # a guard that did not block would finish in far less than 0.2 s
    assert not done.wait(0.2), "the guard must wait while b is unread"
    assert capture.copied_bytes == 4 * 4
    assert torch.equal(_read(capture, keys[1], b), torch.arange(8.0))
    # the guard returns as soon as b is read; 5 s means it never did
    step.join(5)
    assert done.is_set() and torch.equal(_read(capture, keys[0], a), torch.arange(4.0))
    assert capture.failure is None and capture.blocked_s > 0


def test_an_in_place_change_while_or_before_the_writer_reads_is_a_one_line_failure():
    a, b = torch.arange(4.0), torch.arange(8.0)
    capture, keys = _capture(0, a, b)
    t, was_live = capture.begin(keys[0], a)
    a.add_(1.0)  # during the read
    capture.end(keys[0], was_live)
    assert "tensor model.w0 was changed in place while the writer read it" in capture.failure
    assert "\n" not in capture.failure and "step 5" in capture.failure

    capture, keys = _capture(0, a, b)
    b.zero_()  # before it
    _read(capture, keys[1], b)
    assert "model.w1 was changed in place after the save and before the writer read it" in capture.failure


def test_a_change_through_a_live_tensor_with_its_own_version_counter_is_caught():
    """The FSDP2 case on plain tensors: the state dict's entry and the parameter view the same
    memory with separate version counters (`.data` makes such a pair); the parameter is changed."""
    param = torch.arange(4.0)
    entry = param.data
    assert entry._version == param._version == 0
    unwatched = StreamCapture({"model": {"w": entry}}, 0, step=5)
    watched = StreamCapture({"model": {"w": entry}}, 0, step=5, live=[param])
    for capture in (unwatched, watched):
        key = capture.key_of(entry)
        capture.plan_reads("dcp", [key])
        capture.start()
    param.add_(1.0)
    assert entry._version == 0  # what the capture used to check: nothing moved
    for capture in (unwatched, watched):
        _read(capture, capture.key_of(entry), entry)
    assert unwatched.failure is None
    assert "tensor model.w was changed in place after the save" in watched.failure


def test_read_hook_pauses_the_writer_before_a_live_read_only():
    a = torch.arange(4.0)
    capture, keys = _capture(10**6, a)
    seen: list[str] = []
    stream_capture.READ_HOOK = seen.append
    try:
        _read(capture, keys[0], a)
        capture2, keys2 = _capture(10**6, a)
        capture2.guard("x")
        _read(capture2, keys2[0], a)  # a guard copy: nothing to pause for
    finally:
        stream_capture.READ_HOOK = None
    assert seen == ["model.w0"]


@pytest.mark.slow
def test_stream_save_equals_sync_bit_for_bit_guards_mutations_and_resumes(ws2_scenarios):
    """FSDP2 at 2 ranks, tied embeddings, HF export (slimckpt_testing/scenarios/stream.py)."""
    r = scenario_result(ws2_scenarios, "stream", "stream_result.json")
    # 1: the writer was paused while training stepped; the guard copied the unread rest
    assert not r["committed_while_paused"] and r["guards"] == 1
    assert 0 < r["guard_copied_bytes"] <= r["captured_bytes"]
    for step in ("step3", "step6"):  # every DCP rank file and export file identical to the sync save's
        assert r[step]["differing_files"] == [] and r[step]["tensor_diffs"] == [], r[step]
        assert any(f.startswith("dcp/") for f in r[step]["files"]) and any(
            f.startswith("huggingface/") for f in r[step]["files"]
        )
    assert r["reference"] == r["resumed"], r  # with a resume: bitwise-equal losses
    # 2: budget 0: nothing copied, the optimizer step waited for the writer
    assert all(x["zero_budget_copied_bytes"] == 0 for x in r["ranks"]) and r["zero_budget_blocked_s"] > 0
    # 3: the unguarded in-place change fails the step on every rank, in one line naming the tensor
    for x in r["ranks"]:
        assert not x["mutated_step_committed"], x
        message = x["mutation_failure"]
        assert message and "\n" not in message and f"tensor {r['mutated']} was changed in place" in message


RACES = [
    "add_then_step",
    "add_then_step_no_export",
    "step_without_hook",
    "load_state_dict",
    "local_add_on_rank1",
    "optimizer_reload_then_step",
]


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [2, 1])
def test_stream_save_raced_by_user_code_is_never_committed_with_the_changed_weights(ws2_scenarios, fsdp):
    """Right after save_checkpoint returns, the weights are changed as user code changes them
    (RACES, run by slimckpt_testing/scenarios/stream.py: `p.add_` then the optimizer step, with and without the HF
    export; an optimizer step that runs no guard; `load_state_dict`; `to_local()` changed on one
    rank). FSDP2 reads the live shards: each such step fails on every rank in one line naming the
    tensor, is never committed, and the tracker stays on the last committed step. FSDP1 writes
    the new tensors its sharded state dict is made of: the step commits the saved weights, equal
    to a sync save's file for file."""
    r = scenario_result(
        ws2_scenarios, "stream_raced" if fsdp == 2 else "stream_raced_fsdp1", f"raced_fsdp{fsdp}_result.json"
    )
    assert r["fsdp"] == fsdp and list(r["cases"]) == RACES
    tracker = 1
    for step, (name, case) in enumerate(r["cases"].items(), start=10):
        must_fail = case["must_fail"] and fsdp == 2
        ranks = case["ranks"]
        if must_fail:
            assert not any(x["committed"] for x in ranks), (name, case)
            assert case["tracker"] == tracker and case["tracker_error"], (name, case)
            for _rank, x in enumerate(ranks):
                message = x["failure"]
                assert message and "\n" not in message and "was changed in place" in message, (name, x)
                assert "tensor model." in message and "this step is not committed" in message, (name, x)
            if name == "local_add_on_rank1":  # changed on rank 1 only: rank 0 names rank 1
                assert ranks[0]["failure"].endswith("(rank 1)"), ranks[0]
        else:
            assert all(x["committed"] and x["failure"] is None for x in ranks), (name, case)
            tracker = case["tracker"]
            assert case["tracker_error"] is None and tracker == step, (name, case)
            same = case["same_as_sync"]
            assert same["differing_files"] == [] and same["tensor_diffs"] == [], (name, same)
            assert any(f.startswith("dcp/") for f in same["files"]), same
            assert any(f.startswith("huggingface/") for f in same["files"]) == case["export_hf"], same
