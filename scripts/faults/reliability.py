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
from scripts.faults.forks import child_error, fork, fresh_dir, read_events, wait_all, wait_save_begin
from scripts.faults.reliability_merge import MERGE_FIXTURE, merge_calibration, merge_fixture, merge_trial
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
KEEP_BAD = 5  # trial dirs kept per mode for diagnosis


# --------------------------------------------------------------------------- processes


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


# --------------------------------------------------------------------------- merge modes


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
