"""The SIGKILL campaign (scripts/faults/reliability.py): the oracle's classification (fast) and a short
campaign over slimckpt's modes (slow: forks tiny FSDP2 ranks, kills them, resumes)."""

import json
import os
import subprocess
import sys

import pytest

from scripts.faults import oracle

from ..conftest import REPO

H = {"model": "m", "optim": "o", "extra": "e"}


def _record(committed, begun, steps=(1, 2, 3)):
    hashes = {r: {s: {k: f"{v}{s}r{r}" for k, v in H.items()} for s in steps} for r in (0, 1)}
    return oracle.Record(committed=list(committed), begun=list(begun), hashes=hashes)


def _loaded(rec, step, ranks=(0, 1), tamper=None):
    hashes = {r: dict(rec.hashes[r][step]) for r in ranks}
    if tamper:
        hashes[0][tamper] = "x"
    return oracle.Resume(step, None, hashes, ["model", "optim", "extra"])


def test_parse_events_drops_a_torn_line():
    text = '1.0 train 1 \n1.5 hash 1 {"model": "a"}\n2.0 save-begin 1 \n2.5 commi'
    events = oracle.parse_events(text)
    assert [e.kind for e in events] == ["train", "hash", "save-begin"]
    assert json.loads(events[1].detail) == {"model": "a"}
    assert oracle.phase_at(events, 1.7) == "hash" and oracle.phase_at(events, 0.5) == "setup"


def test_build_record_reads_rank0_commits_and_every_rank_hash():
    ev = {
        0: oracle.parse_events('1 hash 1 {"model": "a"}\n2 save-begin 1 \n3 committed 1 \n4 save-begin 2 '),
        1: oracle.parse_events('1 hash 1 {"model": "b"}\n5 committed 9 '),
    }
    rec = oracle.build_record(ev)
    assert rec.committed == [1] and rec.begun == [1, 2] and rec.last_committed == 1
    assert rec.hashes[1][1] == {"model": "b"}
    assert oracle.allowed_steps(rec) == {1, 2}


def test_exact_last_committed_and_in_flight_step():
    rec = _record([1, 2], [1, 2, 3])
    assert oracle.classify(rec, _loaded(rec, 2))[0] == "exact"
    assert oracle.classify(rec, _loaded(rec, 3))[0] == "exact"  # its commit point passed before the line


def test_clean_start_only_when_nothing_was_committed():
    assert oracle.classify(_record([], [1]), oracle.Resume(None, None, {}, ["model"]))[0] == "clean-start"
    assert oracle.classify(_record([1], [1, 2]), oracle.Resume(None, None, {}, ["model"]))[0] == "lost-committed"


def test_older_step_is_lost_committed():
    rec = _record([1, 2], [1, 2, 3])
    assert oracle.classify(rec, _loaded(rec, 1))[0] == "lost-committed"


def test_crash_wrong_state_and_partial():
    rec = _record([1, 2], [1, 2, 3])
    crash = oracle.Resume(None, "FileNotFoundError: model_world_size_2_rank_0.pt", {}, ["model"])
    assert oracle.classify(rec, crash)[0] == "crash-on-load"
    assert oracle.classify(rec, _loaded(rec, 2, tamper="optim"))[0] == "loaded-wrong-state"
    assert oracle.classify(rec, _loaded(rec, 3, tamper="model"))[0] == "loaded-partial"
    assert oracle.classify(rec, _loaded(rec, 2, ranks=(0,)))[0] == "loaded-wrong-state"  # a rank missing


def test_only_loaded_contents_are_compared():
    rec = _record([1], [1])
    res = _loaded(rec, 1, tamper="optim")
    res.compared = ["model"]  # quickstart restarts the optimizer
    assert oracle.classify(rec, res)[0] == "exact"


def test_merge_outcomes():
    assert oracle.classify_merge(False, False, False, True) == "absent"
    assert oracle.classify_merge(True, True, True, True) == "complete-verified"
    assert oracle.classify_merge(True, False, False, True) == "looks-complete-but-broken"
    assert oracle.classify_merge(False, False, False, False) == "rerun-failed"


@pytest.mark.slow
def test_sigkill_campaign_slimckpt_modes(tmp_path):
    out = tmp_path / "sigkill.json"
    # quickstart (verl's save path under slimckpt's retention) and verl's own modes: `make faults` only
    cmd = [
        sys.executable,
        "-m",
        "scripts.faults.reliability",
        "--trials",
        "2",
        "--keep",
        "2",
        "--modes",
        "incremental-sync",
        "incremental-async",
        "merge",
        "--no-side",
        "--no-report",
        "--json",
        str(out),
        "--work",
        str(tmp_path / "work"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # 2 kills per mode plus each mode's calibration: ~80 s on a loaded host; 600 s is a hang
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert out.exists(), proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for key, entry in data["modes"].items():
        assert "error" not in entry, (key, entry.get("error"))
        assert len(entry["trials"]) == 2
        assert entry["summary"]["bad"] == 0, (
            key,
            [t for t in entry["trials"] if t["outcome"] not in oracle.GOOD + oracle.MERGE_GOOD],
        )
        if entry["kind"] == "save":
            assert entry["calibration"]["control"] == "exact"
            assert entry["summary"]["tracker_names_uncommitted"] == 0
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["incremental-async", "incremental-stream"])
def test_async_keep1_saves_go_on_when_retention_beats_the_tracker_watcher(tmp_path, mode):
    """Async incremental saves at max_actor_ckpt_to_keep=1 through the trainer-level path
    of `make faults`, with the watcher's first look at each step held until retention has deleted
    that step's actor dir. On the broken watcher the uncut run hangs (then a gloo timeout); fixed,
    the four saves go through and the resume is exact at the last step. async_save=stream keeps
    the same retention and tracker behaviour."""
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.faults.keep1", str(tmp_path / "work"), mode],
        capture_output=True,
        text=True,
        # 4 saves of 2 ranks and a resume: ~40 s on a loaded host; the old watcher's hang ends here
        timeout=400,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" not in result, result["error"]
    assert result["late_looks"] == [{"step": s, "actor_gone": True} for s in (1, 2, 3)], result
    assert result["calibration"]["control"] == "exact"
