"""The SIGKILL campaign's merge modes (slimckpt merge and verl's merger): a world-size-2 verl checkpoint to merge, a
merge started and killed at a random moment after its output appeared, and what the killed merge left: absent,
complete and verified, or looking complete but broken; then whether a rerun over it succeeds. reliability.py's
campaign runs them beside the save modes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import time

from scripts.faults import oracle
from scripts.faults import trial as fault_trial
from scripts.faults.forks import fork, fresh_dir, wait_all

# lazy imports: slimckpt loads after reliability.main() put --source's patches/ first

MERGE_FIXTURE = dict(hidden=256, layers=4, vocab=32000)


def file_hashes(root: str, skip: tuple[str, ...] = ()) -> dict[str, str]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel in skip:
                continue
            h = hashlib.sha256()
            with open(os.path.join(dirpath, name), "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            out[rel] = h.hexdigest()
    return out


def weight_files(target: str) -> list[str] | None:
    """The weight files a loader would open, or None when the dir does not look like a model."""
    if not os.path.exists(os.path.join(target, "config.json")):
        return None
    index = os.path.join(target, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                return sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError):
            return None
    if os.path.exists(os.path.join(target, "model.safetensors")):
        return ["model.safetensors"]
    return None


def looks_complete(kind: str, target: str) -> bool:
    """What a user (or a loader) would take for a finished model: config.json plus every weight file
    (and, for slimckpt, its manifest written last)."""
    files = weight_files(target)
    if files is None or not all(os.path.exists(os.path.join(target, f)) for f in files):
        return False
    if kind == "merge":
        from slimckpt.layout.merge_manifest import MANIFEST_NAME

        return os.path.exists(os.path.join(target, MANIFEST_NAME))
    return True


def target_correct(kind: str, target: str, reference: dict[str, str]) -> bool:
    got = file_hashes(target, skip=("manifest.json",))
    same = {k: v for k, v in got.items() if k in reference}
    ok = same == reference
    if kind == "merge":
        from slimckpt.layout.merge_manifest import verify

        ok = ok and not verify(target)
    return ok


def merge_fixture(work: str) -> str:

    out = os.path.join(work, "merge_fixture", "global_step_1", "actor")
    if os.path.exists(os.path.join(out, "fsdp_config.json")):
        return out
    fresh_dir(os.path.dirname(os.path.dirname(out)))
    os.makedirs(os.path.dirname(out))
    f = MERGE_FIXTURE
    pids = [
        fork(
            fault_trial.build_merge_fixture,
            out,
            r,
            f["hidden"],
            f["layers"],
            f["vocab"],
            log=os.path.join(os.path.dirname(os.path.dirname(out)), f"fixture_rank_{r}.log"),
        )
        for r in range(2)
    ]
    codes, hung = wait_all(pids, 300.0)
    if hung or any(codes):
        raise RuntimeError(f"building the merge fixture failed (exit codes {codes})")
    return out


def output_exists(kind: str, target: str) -> bool:
    """The merge has begun writing: slimckpt's `<target>.partial` (or the target), verl's target dir."""
    from slimckpt.layout.merge_manifest import partial_path

    return os.path.exists(target) or (kind == "merge" and os.path.exists(partial_path(target)))


def start_merge(
    kind: str, fixture: str, target: str, overwrite: bool, log: str
) -> tuple[int, float, float | None, int | None]:
    """Fork a merge and poll (1 ms) until its output appears or it exits:
    (pid, start, when the output appeared, wait status if it already exited)."""

    t0 = time.monotonic()
    pid = fork(fault_trial.merge_child, kind, fixture, target, overwrite, log=log)
    while True:
        if output_exists(kind, target):
            return pid, t0, time.monotonic(), None
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return pid, t0, None, status
        time.sleep(0.001)


def run_merge(
    kind: str, fixture: str, target: str, overwrite: bool, timeout: float = 300.0
) -> tuple[int | None, float, float | None]:
    """(exit code, seconds, seconds until the output appeared)."""
    pid, t0, appeared, status = start_merge(kind, fixture, target, overwrite, log=target + ".log")
    if status is None:
        codes, _ = wait_all([pid], timeout)
        code = codes[0]
    else:
        code = os.waitstatus_to_exitcode(status)
    return code, time.monotonic() - t0, None if appeared is None else appeared - t0


def merge_calibration(kind: str, work: str, fixture: str) -> dict:
    trial_dir = fresh_dir(os.path.join(work, kind, "calibration"))
    durations, writes = [], []
    for i in range(3):
        target = os.path.join(trial_dir, f"out_{i}")
        code, seconds, appeared = run_merge(kind, fixture, target, overwrite=False)
        if code != 0 or appeared is None:
            raise RuntimeError(f"{kind}: an uncut merge failed (exit {code}); see {trial_dir}")
        durations.append(seconds)
        writes.append(seconds - appeared)
    if not looks_complete(kind, target):
        raise RuntimeError(f"{kind}: an uncut merge's output does not look complete; see {trial_dir}")
    reference = file_hashes(target, skip=("manifest.json",))
    shutil.rmtree(trial_dir, ignore_errors=True)
    return {
        "merge_s": oracle.quantiles(durations)[2],
        "output_to_exit_s": oracle.quantiles(writes)[2],
        "reference": reference,
    }


def merge_state(kind: str, target: str) -> str:
    """Where the kill left the output."""
    from slimckpt.layout.merge_manifest import MANIFEST_NAME, partial_path

    partial = partial_path(target)
    if os.path.isdir(target) and os.listdir(target):
        return "target present"
    if kind == "merge" and os.path.isdir(partial):
        return (
            "partial with manifest" if os.path.exists(os.path.join(partial, MANIFEST_NAME)) else "partial, no manifest"
        )
    return "nothing yet"


def merge_trial(
    kind: str, work: str, fixture: str, index: int, rng: random.Random, window: float, reference: dict[str, str]
) -> dict:
    trial_dir = fresh_dir(os.path.join(work, kind, f"trial_{index:03d}"))
    target = os.path.join(trial_dir, "out")
    delay = rng.uniform(0.0, window)
    pid, t0, appeared, status = start_merge(kind, fixture, target, False, log=os.path.join(trial_dir, "killed.log"))
    t_ref = appeared if appeared is not None else time.monotonic()
    time.sleep(max(0.0, t_ref + delay - time.monotonic()))
    t_kill = time.monotonic()
    if status is None:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    finished = os.WIFEXITED(status)
    state = merge_state(kind, target)
    complete = looks_complete(kind, target)
    correct = complete and target_correct(kind, target, reference)
    code, _, _ = run_merge(kind, fixture, target, overwrite=True)
    rerun_ok = code == 0 and looks_complete(kind, target) and target_correct(kind, target, reference)
    outcome = oracle.classify_merge(complete, correct, correct, rerun_ok)
    if kind == "verl-merge" and not complete and state == "target present":
        state = "target present, incomplete"
    trial = {
        "trial": index,
        "kill_after_start_s": round(t_kill - t0, 4),
        "kill_after_output_s": round(t_kill - t_ref, 4),
        "finished_before_kill": finished,
        "state": state,
        "looks_complete": complete,
        "correct": correct,
        "rerun_ok": rerun_ok,
        "outcome": outcome,
    }
    if outcome in oracle.MERGE_BAD:
        trial["kept_dir"] = trial_dir
    else:
        shutil.rmtree(trial_dir, ignore_errors=True)
    return trial
