"""`make faults`: crash-safety figures of slimckpt next to verl 0.9.1's own checkpoint path, on CPU.

    python -m scripts.faults.reliability                      # 50 SIGKILL trials per mode + the other campaigns
    python -m scripts.faults.reliability --trials 5 --modes incremental-async merge
    python -m scripts.faults.reliability --render             # re-render RELIABILITY.md from docs/reliability/*.json

SIGKILL campaign: for each mode, a pair of ranks (forked from this process, which imported torch,
transformers and verl once) trains a tiny FSDP2 Llama and its critic (PPO) and saves both every step,
with the recipe files' checkpoint blocks as shipped, through verl's own trainer code (scripts/faults/trial.py says exactly what is real); at a uniformly random moment both
ranks are SIGKILLed; a fresh pair then resumes with resume_mode=auto through verl's
`_load_checkpoint`, and the oracle (scripts/faults/oracle.py) compares the step and the state it
loaded with what the savers recorded (hash of every rank's model, optimizer, scheduler+RNG, fsynced
before each save). Merge modes kill `slimckpt merge` (or verl's own merger) part-way, check the
target, then rerun it.

Also runs scripts/faults/corruption.py (its damaged-newest-step restarts too), scripts/faults/env.py and scripts/faults/ranks.py (`--json OUT`) when they exist,
then writes docs/reliability/*.json and RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import logging
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings

# lazy imports: slimckpt, torch and verl load after main() put --source's patches/ first and quiet_imports()
# set the environment they read at import
from scripts.faults import oracle
from scripts.faults import trial as fault_trial
from scripts.faults.reliability_report import OUT_DIR, load_json, reliability_md, summarize
from scripts.faults.report import FAULT_SCRIPTS, OURS, SIDE_CODE, SIDE_MODULES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPORT = os.path.join(REPO, "RELIABILITY.md")
SAVE_MODES = ("verl-default", "quickstart", "incremental-sync", "incremental-async", "incremental-stream")
ALL_MODES = SAVE_MODES + ("merge", "verl-merge")
CALIBRATION_STEPS = 4
KILL_STEPS = 4  # a trial's kill lands in the save of a random step 1..KILL_STEPS
WINDOW_FACTOR = 1.3  # ... within 1.3x the time from a save's start to its commit
CALIBRATION_TIMEOUT_S = 180.0  # 4 saves of an actor and its critic take minutes when the CPUs are shared
CHECK_TIMEOUT_S = 120.0
MERGE_FIXTURE = dict(hidden=256, layers=4, vocab=32000)
KEEP_BAD = 5  # trial dirs kept per mode for diagnosis


# --------------------------------------------------------------------------- processes


def _die_with_parent() -> None:
    """A child SIGKILLed when the campaign dies (else a rank waits in a collective forever)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def fork(body, *args, log: str | None = None) -> int:
    """A child running `body(*args)`; its stdout/stderr go to `log` (verl prints a lot)."""

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _die_with_parent()
        if log is not None:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        fault_trial.run_child(body, *args)
    return pid


def wait_all(pids: list[int], timeout: float) -> tuple[list[int | None], bool]:
    """Exit codes (None: killed by a signal); kills everything left after `timeout`."""
    deadline = time.monotonic() + timeout
    codes: dict[int, int | None] = {}
    hung = False
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else None
        if len(codes) < len(pids):
            if time.monotonic() > deadline:
                hung = True
                for pid in pids:  # every thread's stack into the child's log first (faulthandler)
                    if pid not in codes:
                        os.kill(pid, signal.SIGUSR1)
                time.sleep(1.0)
                for pid in pids:
                    if pid not in codes:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                        codes[pid] = None
            time.sleep(0.005)
    return [codes[p] for p in pids], hung


def read_events(trial_dir: str) -> dict[int, list[oracle.Event]]:
    out = {}
    for rank in range(2):
        path = os.path.join(trial_dir, f"events_rank_{rank}.log")
        with open(path) if os.path.exists(path) else open(os.devnull) as f:
            out[rank] = oracle.parse_events(f.read())
    return out


def child_error(trial_dir: str) -> str | None:
    """The last exception line a child logged."""
    for name in sorted(os.listdir(trial_dir)):
        if name.endswith(".log") and not name.startswith("events"):
            with open(os.path.join(trial_dir, name), errors="replace") as f:
                lines = [
                    ln.strip() for ln in f if ln.strip() and not ln.startswith(" ") and ("Error" in ln or "error" in ln)
                ]
            if lines:
                return lines[-1][:300]
    return None


class Tail:
    """Rank 0's event log read incrementally (the parent polls it every millisecond)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset = 0
        self.buf = b""

    def events(self) -> list[oracle.Event]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        self.buf += data
        complete, _, self.buf = self.buf.rpartition(b"\n")
        return oracle.parse_events(complete.decode(errors="replace")) if complete else []


def wait_save_begin(trial_dir: str, pids: list[int], step: int, timeout: float = 120.0) -> float:
    """Wait until rank 0 begins the save of `step`; returns that moment (its event's time)."""
    tail = Tail(os.path.join(trial_dir, "events_rank_0.log"))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in tail.events():
            if ev.kind == "save-begin" and ev.step == step:
                return ev.t
        for pid in pids:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                raise RuntimeError(f"a saver exited before the save of step {step}; see {trial_dir}")
        time.sleep(0.001)
    raise RuntimeError(f"no save of step {step} after {timeout:.0f} s ({trial_dir})")


# --------------------------------------------------------------------------- save modes


def resume(mode: str, trial_dir: str, keep: int | None) -> oracle.Resume:

    pids = [
        fork(fault_trial.checker, mode, trial_dir, r, keep, log=os.path.join(trial_dir, f"check_rank_{r}.log"))
        for r in range(2)
    ]
    codes, hung = wait_all(pids, CHECK_TIMEOUT_S)
    compared = fault_trial.compared_contents(mode)
    result_path = os.path.join(trial_dir, "resume_result.json")
    if hung or not os.path.exists(result_path):
        why = "hung" if hung else f"exit codes {codes}"
        return oracle.Resume(None, f"resume process died ({why})", {}, compared)
    with open(result_path) as f:
        result = json.load(f)
    hashes = {}
    for rank in range(2):
        path = os.path.join(trial_dir, f"resume_hash_rank_{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                hashes[rank] = json.load(f)
    return oracle.Resume(result["step"] or None, result["error"], hashes, compared)


def leftovers(root: str) -> dict:
    """What the kill left: tracker, step dirs and, per step, whether its actor and critic dirs hold a
    commit record."""
    from slimckpt.layout.resume_manifest import MANIFEST_NAME, read_tracker

    steps = {}
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            if name.startswith("global_step_"):
                actor, critic = os.path.join(root, name, "actor"), os.path.join(root, name, "critic")
                steps[name] = {
                    "actor": os.path.isdir(actor),
                    "manifest": all(os.path.exists(os.path.join(d, MANIFEST_NAME)) for d in (actor, critic)),
                    "data.pt": os.path.exists(os.path.join(root, name, "data.pt")),
                }
    tracker = None
    if os.path.exists(os.path.join(root, "latest_checkpointed_iteration.txt")):
        tracker = read_tracker(root)
        if tracker is None:
            tracker = "unreadable"
    return {"tracker": tracker, "steps": steps}


def tracker_names_uncommitted(mode: str, found: dict) -> bool:
    """Incremental modes: the tracker names a step whose actor or critic dir has no manifest, or no data.pt."""
    step = found["tracker"]
    if not mode.startswith("incremental") or step is None:
        return False
    if step == "unreadable":
        return True
    info = found["steps"].get(f"global_step_{step}")
    return not (info and info["manifest"] and info["data.pt"])


def calibrate(mode: str, work: str, keep: int | None) -> dict:
    """An uncut run of CALIBRATION_STEPS saves: the train+save period, and a resume that must be
    exact at the last step (checks the oracle itself)."""

    trial_dir = fresh_dir(os.path.join(work, mode, "calibration"))
    pids = [
        fork(
            fault_trial.saver,
            mode,
            trial_dir,
            r,
            keep,
            CALIBRATION_STEPS,
            log=os.path.join(trial_dir, f"save_rank_{r}.log"),
        )
        for r in range(2)
    ]
    codes, hung = wait_all(pids, CALIBRATION_TIMEOUT_S)
    if hung or any(codes):
        raise RuntimeError(
            f"{mode}: the uncut run of {CALIBRATION_STEPS} saves failed: "
            f"{child_error(trial_dir) or ('hung' if hung else f'exit codes {codes}')}"
        )
    events = read_events(trial_dir)
    rec = oracle.build_record(events)
    returned = [e.t for e in events[0] if e.kind == "save-returned"]
    saves = [b.t for b in events[0] if b.kind == "save-begin"]
    res = resume(mode, trial_dir, keep)
    outcome, why = oracle.classify(rec, res)
    if outcome != "exact" or res.step != CALIBRATION_STEPS:
        raise RuntimeError(f"{mode}: an uncut run does not resume exactly ({outcome}: {why}); see {trial_dir}")
    save_s = [r - s for s, r in zip(saves, returned)]
    committed = {e.step: e.t for e in events[0] if e.kind == "committed"}
    commit_s = [committed[e.step] - e.t for e in events[0] if e.kind == "save-begin" and e.step in committed]
    shutil.rmtree(trial_dir, ignore_errors=True)
    return {
        "period_s": (returned[-1] - returned[0]) / (CALIBRATION_STEPS - 1),
        "save_call_s": oracle.quantiles(save_s)[2],
        "save_to_commit_s": oracle.quantiles(commit_s)[2],
        "control": outcome,
    }


def save_trial(mode: str, work: str, index: int, rng: random.Random, window: float, keep: int | None) -> dict:
    """Kill both ranks at a uniform moment within `window` s of the start of the save of a random
    step 1..KILL_STEPS (so retention has run from step 2 or 3 on)."""

    trial_dir = fresh_dir(os.path.join(work, mode, f"trial_{index:03d}"))
    pids = [
        fork(
            fault_trial.saver,
            mode,
            trial_dir,
            r,
            keep,
            fault_trial.MAX_STEPS,
            log=os.path.join(trial_dir, f"save_rank_{r}.log"),
        )
        for r in range(2)
    ]
    target_step = rng.randint(1, KILL_STEPS)
    delay = rng.uniform(0.0, window)
    t_ready = wait_save_begin(trial_dir, pids, target_step)
    time.sleep(max(0.0, t_ready + delay - time.monotonic()))
    t_kill = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        os.waitpid(pid, 0)
    events = read_events(trial_dir)
    rec = oracle.build_record(events)
    found = leftovers(os.path.join(trial_dir, "ckpt"))
    res = resume(mode, trial_dir, keep)
    outcome, why = oracle.classify(rec, res)
    pending = sorted(set(rec.begun) - set(rec.committed))
    trial = {
        "trial": index,
        "target_step": target_step,
        "kill_after_save_begin_s": round(t_kill - t_ready, 4),
        "kill_fraction_of_window": round((t_kill - t_ready) / window, 3),
        "phase_rank0": oracle.phase_at(events[0], t_kill),
        "phase_rank1": oracle.phase_at(events[1], t_kill),
        "step_at_kill": max(rec.begun) if rec.begun else 0,
        "last_committed": rec.last_committed,
        "pending": pending,
        "loaded": res.step or 0,
        "outcome": outcome,
        "why": why,
        "found": found,
        "tracker_names_uncommitted": tracker_names_uncommitted(mode, found),
    }
    keep_dir = outcome in oracle.BAD or trial["tracker_names_uncommitted"]
    if not keep_dir:
        shutil.rmtree(trial_dir, ignore_errors=True)
    else:
        trial["kept_dir"] = trial_dir
    return trial


def fresh_dir(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


# --------------------------------------------------------------------------- merge modes


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


# --------------------------------------------------------------------------- campaign


def sigkill_campaign(
    runs: list[tuple[str, int | None]], trials: int, seed: int, work: str, out_path: str | None = None
) -> dict:
    """`runs`: (mode, max_ckpt_to_keep) pairs; results keyed "mode" or "mode@keep=K". The JSON at
    `out_path` is rewritten after every mode, so a campaign cut short keeps what it finished."""
    from tqdm import tqdm

    rng = random.Random(seed)
    result: dict = {"trials_per_mode": trials, "seed": seed, "world_size": 2, "modes": {}}
    fixture = merge_fixture(work) if any(m in ("merge", "verl-merge") for m, _ in runs) else None
    for mode, keep in runs:
        key = run_key(mode, keep)
        t0 = time.monotonic()
        if mode in SAVE_MODES:
            entry = {
                "kind": "save",
                "mode": mode,
                "max_ckpt_to_keep": keep,
                "checkpoint": fault_trial.checkpoint_block(mode),
                "critic_checkpoint": fault_trial.checkpoint_block(mode, "critic"),
                "trials": [],
            }
            try:
                cal = calibrate(mode, os.path.join(work, key), keep)
            except RuntimeError as exc:  # a finding in itself: reported, the campaign goes on
                entry.update(error=str(exc), seconds=round(time.monotonic() - t0, 1), summary={"bad": None})
                result["modes"][key] = entry
                print(f"{key}: {exc}", flush=True)
                continue
            window = WINDOW_FACTOR * cal["save_to_commit_s"]
            entry.update(calibration=cal, window_s=window)
            bad = 0
            for i in tqdm(range(trials), desc=f"SIGKILL {key}", leave=False):
                trial = save_trial(mode, os.path.join(work, key), i, rng, window, keep)
                if "kept_dir" in trial:
                    bad += 1
                    if bad > KEEP_BAD:
                        shutil.rmtree(trial.pop("kept_dir"), ignore_errors=True)
                entry["trials"].append(trial)
        else:
            cal = merge_calibration(mode, work, fixture)
            window = 1.15 * cal["output_to_exit_s"]
            entry = {
                "kind": "merge",
                "mode": mode,
                "window_s": window,
                "calibration": {k: cal[k] for k in ("merge_s", "output_to_exit_s")},
                "fixture": dict(MERGE_FIXTURE),
                "trials": [],
            }
            for i in tqdm(range(trials), desc=f"SIGKILL {mode}", leave=False):
                entry["trials"].append(merge_trial(mode, work, fixture, i, rng, window, cal["reference"]))
        entry["seconds"] = round(time.monotonic() - t0, 1)
        entry["summary"] = summarize(entry)
        result["modes"][key] = entry
        print(f"{key}: {entry['summary']['outcomes']} ({entry['seconds']:.0f} s)", flush=True)
        if out_path:
            with open(out_path, "w") as f:
                json.dump({**result, "partial": True}, f, indent=1)
    return result


def run_key(mode: str, keep: int | None) -> str:
    return mode if mode not in SAVE_MODES else f"{mode}@keep={keep}"


# the campaigns beside the SIGKILL one: (script, result file, arguments)
SIDES = {
    "corruption": ("corruption_campaign.py", "corruption.json", ()),
    "damaged": ("corruption_campaign.py", "damaged_restarts.json", ("--damaged_restarts", "30")),
    "env": ("env_faults.py", "env_faults.json", ()),
    # a stall lasts until the survivors time out: a 5 s group timeout keeps 10 stalls per mode
    # to minutes; what is checked (the lost rank named, ended within the timeout) is the same
    "ranks": ("rank_faults.py", "rank_faults.json", ("--timeout", "5")),
}


def side_campaign(script: str, out: str, source: str | None = None, args: tuple[str, ...] = ()) -> dict | None:
    """Another helper's campaign script, when it exists: `python <script> --json OUT`, on the snapshot's
    slimckpt when there is one (--source/--snapshot), as the SIGKILL campaign."""
    module = SIDE_MODULES[script]
    if not os.path.exists(os.path.join(REPO, *module.split(".")) + ".py"):
        return None
    env = dict(os.environ)
    if source:
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(os.path.abspath(source), "patches")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", module, *args, "--json", out], cwd=REPO, capture_output=True, text=True, env=env
    )
    seconds = time.monotonic() - t0
    if proc.returncode != 0 and not os.path.exists(out):
        return {
            "error": f"{script} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-400:]}",
            "seconds": seconds,
        }
    with open(out) as f:
        json.load(f)  # its report must at least parse: a torn file fails here, not in the rendering
    return {"seconds": seconds, "returncode": proc.returncode}


SOURCE_COMMIT = [None]


def export_head(dest: str) -> str:
    """`git archive HEAD patches recipes` into `dest`, with the commit in dest/COMMIT."""
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    archive = subprocess.run(
        ["git", "archive", "HEAD", "patches", "recipes"], cwd=REPO, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    with open(os.path.join(dest, "COMMIT"), "w") as f:
        f.write(head[:12])
    return dest


def source_note() -> str:
    """Which slimckpt the trials ran (others may be editing the working tree meanwhile)."""
    import slimckpt

    where = os.path.dirname(os.path.dirname(os.path.abspath(slimckpt.__file__)))
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    if SOURCE_COMMIT[0]:
        return f"a clean export of commit {SOURCE_COMMIT[0]} (patches/ and recipes/)"
    if where == os.path.join(REPO, "patches"):
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "patches"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        return f"the working tree at {head}" + (" with uncommitted changes" if dirty else "")
    return f"{where} (SLIMCKPT source outside the repo; repo HEAD {head})"


def source_commit() -> dict:
    """What the renderer checks each row against HEAD with (report.staleness): the commit of the
    slimckpt the trials ran, and whether code taken from the working tree had uncommitted changes
    (the snapshot's patches/ and recipes/ are clean by construction; the scripts always come from
    the working tree). {"commit": None} when git cannot say."""
    import slimckpt

    where = os.path.dirname(os.path.dirname(os.path.abspath(slimckpt.__file__)))
    scripts = list(
        dict.fromkeys(
            FAULT_SCRIPTS
            + tuple(p for paths in SIDE_CODE.values() for p in paths if p.startswith(("scripts/", "tests/")))
        )
    )
    if SOURCE_COMMIT[0]:
        commit, paths = SOURCE_COMMIT[0], scripts
    elif where == os.path.join(REPO, "patches"):
        commit, paths = None, ["patches", "recipes"] + scripts
    else:
        return {"commit": None, "dirty": None}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", *paths], cwd=REPO, capture_output=True, text=True
        )
    except OSError:
        return {"commit": commit, "dirty": None}
    if head.returncode or status.returncode:
        return {"commit": commit, "dirty": None}
    return {"commit": commit or head.stdout.strip()[:12], "dirty": bool(status.stdout.strip())}


def run_sigkill(args: argparse.Namespace, argv: list[str] | None) -> dict:
    import torch
    import verl

    t0 = time.monotonic()
    load_start = os.getloadavg()[0]
    runs = [(m, k) for k in args.keep for m in args.modes if m in SAVE_MODES] + [
        (m, None) for m in args.modes if m not in SAVE_MODES
    ]
    out_path = args.json or os.path.join(OUT_DIR, "sigkill.json")
    sigkill = sigkill_campaign(runs, args.trials, args.seed, args.work, out_path)
    sigkill["seconds"] = round(time.monotonic() - t0, 1)
    sigkill["load_average_1min"] = {"start": round(load_start, 1), "end": round(os.getloadavg()[0], 1)}
    sigkill["command"] = "python -m scripts.faults.reliability " + " ".join(argv if argv is not None else sys.argv[1:])
    sigkill["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "verl": verl.__version__,
    }
    sigkill["source"] = source_note()
    sigkill.update(source_commit())
    with open(out_path, "w") as f:
        json.dump(sigkill, f, indent=1)
    return sigkill


def quiet_imports() -> None:
    """Before any fork: slimckpt unset from the environment (verl's default mode must run unpatched),
    quiet logs, one thread, and torch, transformers and verl imported once."""
    for var in ("SLIMCKPT_CHECKPOINT", "SLIMCKPT_MEASURE", "SLIMCKPT_CPU"):
        os.environ.pop(var, None)
    os.environ.setdefault("SLIMCKPT_LOG_LEVEL", "ERROR")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    warnings.filterwarnings("ignore")

    logging.disable(logging.WARNING)
    import torch

    torch.set_num_threads(1)
    import transformers  # noqa: F401
    import verl  # noqa: F401
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer  # noqa: F401
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--trials", type=int, default=50, help="SIGKILL trials per mode (default 50)")
    p.add_argument("--modes", nargs="+", choices=ALL_MODES, default=list(ALL_MODES), help="modes (default all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill times (default 0)")
    p.add_argument(
        "--keep",
        type=int,
        nargs="+",
        default=[2, 1],
        help="trainer.max_actor_ckpt_to_keep values; every save mode runs with each (default 2 1: "
        "the recipes' value, and the riskiest retention)",
    )
    p.add_argument("--work", default=os.path.join(REPO, "runs", "faults"), help="scratch dir (default runs/faults)")
    p.add_argument(
        "--source",
        default=None,
        help="a snapshot holding patches/ and recipes/ (e.g. `git archive HEAD patches recipes`) to test "
        "instead of the working tree, which others may be editing",
    )
    p.add_argument(
        "--snapshot",
        action="store_true",
        help="test the last commit: export HEAD's patches/ and recipes/ into the scratch dir and use that as --source",
    )
    p.add_argument("--json", default=None, help="write the SIGKILL results here instead of docs/reliability/")
    p.add_argument("--no-side", action="store_true", help="skip the campaigns beside the SIGKILL one")
    p.add_argument(
        "--sides",
        nargs="+",
        choices=list(SIDES),
        default=list(SIDES),
        help="which campaigns beside the SIGKILL one to run (default all; the others keep their last results)",
    )
    p.add_argument("--no-report", action="store_true", help="do not write RELIABILITY.md")
    p.add_argument(
        "--side-only", action="store_true", help="run only the corruption and environment campaigns, then render"
    )
    p.add_argument("--render", action="store_true", help="only re-render RELIABILITY.md from docs/reliability/")
    args = p.parse_args(argv)
    if args.snapshot and not args.render:
        args.source = export_head(os.path.join(args.work, "source"))
    if args.source:
        stamp = os.path.join(args.source, "COMMIT")
        if os.path.exists(stamp):
            with open(stamp) as f:
                SOURCE_COMMIT[0] = f.read().strip()
        sys.path.insert(0, os.path.join(os.path.abspath(args.source), "patches"))
    if not args.render:
        quiet_imports()

        if args.source:
            fault_trial.RECIPES_DIR = os.path.join(os.path.abspath(args.source), "recipes")
        os.makedirs(OUT_DIR, exist_ok=True)
        os.makedirs(args.work, exist_ok=True)
        if not args.side_only:
            sigkill = run_sigkill(args, argv)
            if args.json:
                return 0 if all(m["summary"]["bad"] == 0 for m in sigkill["modes"].values() if m["mode"] in OURS) else 1
        if not args.no_side:
            runs = load_json("side_runs.json") or {}  # campaigns not chosen this time keep their entries
            for script, name, extra in (SIDES[side] for side in args.sides):
                side = side_campaign(script, os.path.join(OUT_DIR, name), args.source, extra)
                if side is None:
                    continue
                runs[" ".join((script, *extra))] = {
                    "seconds": round(side["seconds"], 1),
                    "returncode": side.get("returncode"),
                    **source_commit(),
                }
                print(f"{script}: {'error' if 'error' in side else 'done'} ({side['seconds']:.0f} s)", flush=True)
                if "error" in side:
                    with open(os.path.join(OUT_DIR, name), "w") as f:
                        json.dump(side, f, indent=1)
            with open(os.path.join(OUT_DIR, "side_runs.json"), "w") as f:
                json.dump(runs, f, indent=1)
    if not args.no_report:
        with open(REPORT, "w") as f:
            f.write(reliability_md())
        print(f"wrote {REPORT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
