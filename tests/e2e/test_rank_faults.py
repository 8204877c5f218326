"""One rank lost while the others are in a save's collectives: the heartbeat that names it (fast, a
store in this process) and scripts/faults/ranks.py's campaign (slow: forks tiny FSDP2 ranks over
gloo, SIGKILLs or SIGSTOPs one of them mid-save, resumes)."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ..conftest import REPO

GLOO_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:57578. This is typically caused by a remote worker crashing."
)
GLOO_TIMEOUT = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 5000ms for "
    "send operation to complete"
)


def test_peer_loss_is_told_from_other_failures():
    import slimckpt.dist.heartbeat as peers

    wrapped = RuntimeError("slimckpt: the background write of step 3 failed")
    wrapped.__cause__ = RuntimeError(GLOO_TIMEOUT)
    assert peers.is_peer_loss(RuntimeError(GLOO_CLOSED)) and peers.is_peer_loss(wrapped)
    assert str(peers.peer_error(wrapped)) == GLOO_TIMEOUT
    # a group created inside the save (its rendezvous in the store) with a rank that never arrives
    assert peers.is_peer_loss(RuntimeError("Wait timeout"))
    assert peers.is_peer_loss(RuntimeError("wait timeout after 5000ms, keys: /default_pg/1//cpu//0"))
    assert not peers.is_peer_loss(OSError(28, "No space left on device"))
    assert not peers.is_peer_loss(RuntimeError("file write failed"))


def _beats(store, world, interval):
    from slimckpt.dist.heartbeat import Heartbeat

    return [Heartbeat(store, r, world, prefix="t", interval=interval) for r in range(world)]


def test_silent_names_the_rank_whose_beat_stopped():
    import torch.distributed as dist

    beats = _beats(dist.HashStore(), 3, 0.05)
    beats[0].start(), beats[2].start()
    beats[1].start()
    beats[1].stop()  # rank 1 "dies": its thread stops beating
    # two 0.05 s beat intervals: the live beats are counting, rank 1's has stopped, before silent() looks
    time.sleep(0.1)
    try:
        assert beats[0].silent() == ([1], "")
        assert beats[2].silent() == ([1], "")
    finally:
        beats[0].stop(), beats[2].stop()


def test_watch_ends_on_a_stopped_peer_only_after_its_timeout():
    import torch.distributed as dist

    store = dist.HashStore()
    beats = _beats(store, 2, 0.05)
    for b in beats:
        b.start()
    called: list = []
    done = threading.Event()
    beats[0].watch(0.5, lambda ranks, note: (called.append((ranks, time.monotonic())), done.set()))
    try:
        # longer than the 0.5 s watch timeout: a watcher that took live beats for silence has fired
        time.sleep(0.8)
        assert not called  # both beating: a slow collective is not a dead rank
        stopped = time.monotonic()
        beats[1].stop()
        # the watch fires ~0.5 s after the stop; 5 s means it never did
        assert done.wait(5.0)
        ranks, when = called[0]
        assert ranks == [1] and when - stopped >= 0.5 - 2 * 0.05  # its last beat may precede the stop by one interval
    finally:
        beats[0].stop(), beats[1].stop()


def test_the_store_going_silent_names_its_host():
    import slimckpt.dist.heartbeat as peers

    class Gone:
        def add(self, key, n):
            raise RuntimeError("Connection reset by peer")

    beat = peers.Heartbeat(Gone(), 2, 3, interval=0.01)
    ranks, note = beat.silent()
    assert ranks == [0] and "store" in note


@pytest.mark.slow
def test_one_rank_killed_or_stalled_mid_save(tmp_path):
    """Per save mode (sync, pool, stream; export on, as the recipe ships): one SIGKILL and one
    SIGSTOP (longer than the 4 s group timeout) of a random rank of 2 at a random moment of a save,
    then one of each at a commit's outcome (the manifest that completes the step written, the ranks
    not yet told): the survivors end within the timeout plus the few heartbeats that name the rank,
    in a line naming it; nothing partial committed, no orphan or held lock, the relaunch resumes
    exactly, and a step whose manifest was written before the fault is never given up."""
    out = tmp_path / "rank_faults.json"
    # short, so a stalled trial ends in seconds; long beside a healthy collective of this tiny save
    timeout = 4.0
    cmd = [
        sys.executable,
        "-m",
        "scripts.faults.ranks",
        "--kills",
        "1",
        "--stalls",
        "1",
        "--at-commit",
        "1",
        "--keep-dirs",  # tiny: every trial's logs stay for the failure messages below
        "--worlds",
        "2",
        "--timeout",
        str(timeout),
        "--window",
        "0.4",
        "--json",
        str(out),
        "--work",
        str(tmp_path / "work"),
        "--modes",
        "incremental-sync",
        "incremental-async",
        "incremental-stream",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # 12 trials of 2-rank runs: ~140 s on a loaded host; 300 s is a hang
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert out.exists(), proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["modes"]) == {"incremental-sync", "incremental-async", "incremental-stream"}
    for mode, entry in data["modes"].items():
        assert not entry.get("errors"), (mode, entry["errors"])
        assert [(t["fault"], t["at"]) for t in entry["trials"]] == [
            ("kill", "random"),
            ("stall", "random"),
            ("kill", "commit-outcome"),
            ("stall", "commit-outcome"),
        ], mode
        # a fault that lands once every survivor has left the save, or once the step's commit went
        # through, fails the survivors in a collective that is not a save's, with the backend's own
        # error: only faults inside a survivor's save that did not commit must name the rank
        inside = [t for t in entry["trials"] if t["in_save"] and t["last_committed"] != t["step"]]
        assert inside, (mode, entry["trials"])
        for t in entry["trials"]:
            # a hung survivor's log ends with every thread's stack (faulthandler, dumped before the kill)
            assert t["outcome"] in ("exact", "clean"), (mode, t, _logs(t, 8000))
            assert t not in inside or (t["named"] and t["named_ranks"] == [t["victim"]]), (mode, t, _logs(t))
            assert not t["orphans"] and not t["locks_held"], (mode, t)
            limit = timeout + 8.0 if t["fault"] == "stall" else 8.0
            assert t["survivors_end_s"] <= limit, (mode, t, _logs(t, 8000))
    # rank 1 stalled while rank 0, the step's manifests written (the actor's commits on its own thread in
    # the async modes, and may end after the critic's), told the outcome: the async modes' watcher
    # named the step at once, and the relaunch resumes that step (a failure after the manifest used
    # to mark the committed step failed, and the relaunch went one step back). The step is the
    # trainer's too: where rank 0's training thread was held in a collective with the stalled rank
    # before it wrote the step's data.pt, the step is not complete, and the relaunch loads the one before
    for mode in ("incremental-async", "incremental-stream"):
        (stall,) = [t for t in data["modes"][mode]["trials"] if t["at"] == "commit-outcome" and t["fault"] == "stall"]
        assert stall["victim"] == 1 and (stall["tracker"] or 0) == stall["loaded"], (mode, stall, _logs(stall))
        step_dir = Path(stall["kept_dir"]) / "ckpt" / f"global_step_{stall['step']}"
        if (step_dir / "data.pt").exists():
            assert stall["loaded"] == stall["step"], (mode, stall, _logs(stall))
    assert proc.returncode == 0, proc.stderr[-3000:]


def _logs(trial: dict, tail: int = 1500) -> str:
    """The end of each rank's log of a kept trial (the campaign keeps an unnamed one): what the
    survivors said instead of naming the lost rank."""
    kept = trial.get("kept_dir")
    if not kept:
        return "(trial dir not kept)"
    return "\n".join(
        f"--- {p.name}:\n{p.read_text(errors='replace')[-tail:]}" for p in sorted(Path(kept).glob("save_rank_*.log"))
    )
