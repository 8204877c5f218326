"""A load, verify or merge right after a save sees the committed step, in every async_save mode:
verl's checkpoint round trip (slimckpt_testing/scenarios/roundtrip.py) under torchrun, FSDP1 and FSDP2, plus
the in-process registry of commits in flight (slimckpt.storage.in_flight)."""

from __future__ import annotations

import threading
import time

import pytest

from slimckpt.storage import in_flight
from slimckpt_testing.launch import launch

from ..conftest import REPO

MODES = ("sync", "pool", "stream")


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def round_trips(request, tmp_path_factory) -> tuple[int, dict]:
    """One torchrun per strategy; its result per mode (one repeat)."""
    fsdp = request.param
    root = tmp_path_factory.mktemp(f"roundtrip_fsdp{fsdp}")
    run = launch(
        2,
        "slimckpt_testing.scenarios.roundtrip",
        "--dir",
        str(root),
        "--fsdp",
        str(fsdp),
        # ~50 s on a loaded host; above the scenario's own 540 s deadline, so a hang dumps its stacks first
        timeout=600,
        cwd=REPO,
        env={"OMP_NUM_THREADS": "1", "SLIMCKPT_LOG_LEVEL": "WARNING"},
        result=root / f"roundtrip_fsdp{fsdp}_result.json",
    )
    assert run.proc.returncode == 0, run.output
    result = run.result
    return fsdp, {mode: runs[0]["ranks"] for mode, runs in result.items()}


def _ranks(round_trips, mode: str) -> list[dict]:
    _, results = round_trips
    ranks = results[mode]
    for rank, r in enumerate(ranks):
        assert "error" not in r, f"rank {rank} raised:\n{r['error']}"
    return ranks


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_verl_round_trip_is_bit_exact(round_trips, mode):
    """verl's test: the shards after the load are the saved ones, the repeated update gives the
    same logits, bit for bit, on every rank."""
    for rank, r in enumerate(_ranks(round_trips, mode)):
        assert r["shards_differ"] == [], f"rank {rank}"
        assert r["logits_equal"] is True, f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_verify_merge_and_load_wait_for_a_commit_in_flight(round_trips, mode):
    """Rank 0's manifest is written late: its in-process verify and merge, and the other rank's
    load started at once, all find the committed step."""
    ranks = _ranks(round_trips, mode)
    assert ranks[0]["verify"] == "ok"
    merged = ranks[0]["merge"]
    assert isinstance(merged, list), merged
    assert "config.json" in merged and any(f.endswith(".safetensors") for f in merged), merged
    for rank, r in enumerate(ranks):
        assert r["load"] is None, f"rank {rank}: {r['load']}"
        assert r["load_shards_differ"] == [], f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_failed_commit_is_one_line_on_every_rank(round_trips, mode):
    """Rank 0's manifest write hits a full disk: a sync save raises it, an async save's next
    load does, the same line on every rank; the step is never committed."""
    ranks = _ranks(round_trips, mode)
    raised = [r["failed_save"] if mode == "sync" else r["failed_load"] for r in ranks]
    assert raised[0] is not None and raised.count(raised[0]) == len(raised), raised
    assert "\n" not in raised[0] and "step 4" in raised[0] and "No space left on device" in raised[0]
    if mode == "sync":  # the save's own line, with a trainer's fix; the load then refuses the step
        assert raised[0].startswith("SaveFailed: ") and "trainer.default_local_dir" in raised[0]
        refused = [r["failed_load"] for r in ranks]
        assert refused.count(refused[0]) == len(refused) and "has no slimckpt_resume.json" in refused[0], refused
    else:
        assert "not committed" in raised[0]
        assert all(r["failed_save"] is None for r in ranks)  # the save itself returned before the commit
    assert not any(r["failed_committed"] for r in ranks)


def test_wait_for_blocks_until_the_write_of_a_dir_under_it_ends(tmp_path):
    role = tmp_path / "global_step_2" / "actor"
    write = in_flight.begin(str(role))
    waited: list[list[str]] = []
    reader = threading.Thread(target=lambda: waited.append(in_flight.wait_for(str(tmp_path / "global_step_2"))))
    reader.start()
    # the reader thread starts in milliseconds: by now it is inside wait_for if it is going to wait
    time.sleep(0.2)
    assert reader.is_alive() and waited == []  # still in flight
    assert in_flight.wait_for(str(tmp_path / "global_step_3")) == []  # another step does not wait
    in_flight.end(write)
    # end() wakes the reader at once; 5 s means it missed the wake-up
    reader.join(timeout=5)
    assert waited == [[str(role)]]
    assert in_flight.wait_for(str(role)) == []


def test_the_writer_thread_never_waits_for_its_own_write(tmp_path):
    write = in_flight.begin(str(tmp_path / "actor"))
    seen: list[list[str]] = []

    def writer() -> None:
        in_flight.running(write)
        seen.append(in_flight.wait_for(str(tmp_path)))  # e.g. an export that merges the dir it writes

    thread = threading.Thread(target=writer)
    thread.start()
    # a writer that does not wait returns at once; 5 s means it waits for its own write
    thread.join(timeout=5)
    in_flight.end(write)
    assert seen == [[]]
