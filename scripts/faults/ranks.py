"""One rank lost while the others are inside a save's or a distributed merge's collectives.

    python -m scripts.faults.ranks                         # the full campaign (see --kills/--stalls)
    python -m scripts.faults.ranks --kills 4 --stalls 2 --modes incremental-async merge
    python -m scripts.faults.ranks --render                # print the RELIABILITY.md section of the JSON

`make faults` SIGKILLs every rank at once (a preempted job). Here ONE rank of 2 or 3 is SIGKILLed
(a node dies) or SIGSTOPped for longer than the process group's timeout, then SIGCONTed or
SIGKILLed (a node that hangs), at a uniform moment of a save (the ranks run scripts/faults/trial.py's
saver: verl's own `_save_checkpoint` and FSDPCheckpointManager on a tiny FSDP2 Llama over gloo,
with the process group's timeout set short, `--timeout`) or of `slimckpt merge --distributed_merge`
under torchrun. Beside those uniform moments, `--at-commit K` places K more kills and K stalls per
slimckpt save mode and world size where a committed step was once given up: the victim stops itself
once rank 0 has written the manifest that completes a step, before any rank knows the commit's
outcome. Each trial is classified:

- **hung** (bad): a surviving rank was still running `--timeout` + SLACK_S after the fault;
- **orphan** (bad): a process of the trial outlived its rank (the campaign is the subreaper of
  every process it starts), or a slimckpt lock file was still locked once every rank was gone;
- **committed partial** (bad): the tracker names a step without its manifest, or the resume loaded
  a step whose state is not the one recorded before its save;
- **wrong resume** (bad): any other bad outcome of scripts/faults/oracle.py (a committed step lost,
  the resume crashed);
- **exact** / **clean**: the relaunch resumed exactly the last committed step (or one whose commit
  point had just passed), or started clean when nothing was committed yet. For a merge: no target
  that looks complete unless it is complete and correct, and the rerun succeeded.

Separately each trial records whether a survivor's output had one line naming the lost rank, and
how long the survivors took to end after the fault.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import time
import traceback
from datetime import timedelta

from scripts.faults import forks, oracle
from scripts.faults import reliability as rel
from scripts.faults import reliability_merge as rel_merge
from scripts.faults import trial as fault_trial
from scripts.faults.forks import (
    become_subreaper,
    end,
    held_locks,
    named_ranks,
    proc_state,
    reap_orphans,
    wait_until,
    with_signal,
)
from scripts.faults.ranks_merge import merge_calibration, merge_trial
from scripts.faults.ranks_report import AT_COMMIT, render, summarize
from scripts.faults.ranks_settings import KEEP_ALL, SLACK_S, TIMEOUT_S, keep_or_remove

# lazy imports: torch, verl and slimckpt load after reliability.quiet_imports() set the environment they read, before the forks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OUT = os.path.join(REPO, "docs", "reliability", "rank_faults.json")
# mode -> (recipe or None, checkpoint overrides); the first four are scripts/faults/trial.py's
SAVE_MODES = {
    "verl-default": (None, {}),
    "incremental-sync": ("incremental", {"async_save": False}),
    "incremental-async": ("incremental", {"async_save": True}),
    "incremental-stream": ("incremental", {"async_save": "stream"}),
    "incremental-sync-noexport": ("incremental", {"async_save": False, "export_hf": False}),
    "incremental-async-noexport": ("incremental", {"async_save": True, "export_hf": False}),
    "incremental-stream-noexport": ("incremental", {"async_save": "stream", "export_hf": False}),
}
MODES = tuple(SAVE_MODES) + ("merge",)
KILL_STEPS = 3  # the fault lands in the save of a random step 1..KILL_STEPS
STEPS = 40  # savers run this many steps unless a fault ends them
WINDOW_FACTOR = 1.3
COMMIT_WAIT_FACTOR = 2  # group timeouts a commit-outcome victim waits for its step's manifests
# where a save trial's fault lands: "random", a uniform moment of a save; "commit-outcome" (--at-commit),
# the victim stops itself in the commit of the chosen step's last role (the critic) once every role's
# manifest of that step is on disk (the step complete, and the tracker's watcher may name it at once),
# before it knows the commit's outcome (rank 0 right after writing the manifest; another rank as the
# outcome's broadcast begins). The async modes write each role in its own background thread, so the
# actor's commit may still be going on when the critic's manifest is written
ARMED: list[tuple[int, int] | None] = [None]  # (victim rank, step), set in the parent before the fork


# --------------------------------------------------------------------------- ranks


def init_group(trial_dir: str, rank: int, tag: str) -> None:
    """fault_trial's process group with this campaign's (short) timeout."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(trial_dir, f"store_{tag}"), fault_trial.WORLD)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=fault_trial.WORLD, timeout=timedelta(seconds=TIMEOUT_S[0])
    )


def stop_at_commit_outcome(rank: int, step: int) -> None:
    """This rank SIGSTOPs itself at the commit-outcome point of `step`'s last role (AT_COMMIT)."""
    import threading
    import types

    from slimckpt.layout.resume_manifest import MANIFEST_NAME, step_of
    from slimckpt.save import step_commit

    armed = threading.Event()
    armed.set()

    def stop() -> None:
        if armed.is_set():
            armed.clear()
            os.kill(os.getpid(), signal.SIGSTOP)

    def wait_for_the_step(role_dir: str) -> None:
        """Until every role's manifest of the step is on disk: its other roles commit on other threads
        (async modes) or have already (sync). Bounded: where they never come, the fault lands anyway,
        and the rank's log says it is not at the point claimed."""
        step_dir = os.path.dirname(role_dir)
        manifests = [os.path.join(step_dir, role, MANIFEST_NAME) for role in fault_trial.ROLES]
        limit_s = COMMIT_WAIT_FACTOR * TIMEOUT_S[0]
        deadline = time.monotonic() + limit_s
        while not all(os.path.exists(m) for m in manifests) and time.monotonic() < deadline:
            time.sleep(0.002)
        missing = [m for m in manifests if not os.path.exists(m)]
        if missing:
            print(
                f"fault harness: {', '.join(missing)} not written within {limit_s:.0f} s; "
                "stopping anyway: this fault is before the step's commit, not at its outcome",
                file=sys.stderr,
                flush=True,
            )

    if rank == 0:  # register_committed runs right after rank 0's write_manifest
        register = step_commit.register_committed

        def register_committed(manager, local_path, max_keep):
            found = step_of(local_path)
            if found is not None and found[1] == step and os.path.basename(local_path) == fault_trial.ROLES[-1]:
                wait_for_the_step(local_path)
                stop()
            return register(manager, local_path, max_keep)

        step_commit.register_committed = register_committed
        return
    commit, from_rank0 = step_commit.commit, step_commit.outcome.from_rank0
    current = threading.local()

    def commit_of(ctx, *a, **k):
        current.step = int(ctx.step) if os.path.basename(ctx.local_path) == fault_trial.ROLES[-1] else None
        current.role_dir = ctx.local_path
        try:
            return commit(ctx, *a, **k)
        finally:
            current.step = None

    def outcome_from_rank0(*a, **k):
        if getattr(current, "step", None) == step:
            # this rank reaches the broadcast once its part of the collective before it is sent, which
            # rank 0 may not have received yet: stopping here at once can leave rank 0 short of the
            # manifest. The point is rank 0's manifests written and this rank not told.
            wait_for_the_step(current.role_dir)
            stop()
        return from_rank0(*a, **k)

    step_commit.commit = commit_of
    step_commit.outcome = types.SimpleNamespace(**{**vars(step_commit.outcome), "from_rank0": outcome_from_rank0})


def wait_stopped(pid: int, timeout: float = 120.0) -> float | None:
    """The moment `pid` was seen stopped (SIGSTOP), or None if it ended or the timeout passed first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = proc_state(pid)
        if state == "T":
            return time.monotonic()
        if state in (None, "Z", "X"):
            return None
        time.sleep(0.002)
    return None


def rank_saver(mode: str, trial_dir: str, rank: int, keep: int | None, steps: int) -> None:
    """fault_trial's saver; a failure ends this rank as an interpreter exit would (atexit: slimckpt
    finishes, or fails, the background write in flight), so what it says about a lost peer is in the
    log."""

    if ARMED[0] is not None and ARMED[0][0] == rank:
        stop_at_commit_outcome(rank, ARMED[0][1])
    try:
        fault_trial.saver(mode, trial_dir, rank, keep, steps)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        from slimckpt.save.resume_state import finish_pending

        finish_pending()
        raise


def run_or_raise(run, message: list) -> None:
    """fault_trial's worker-group call, as Ray's is when a worker fails: the failing rank raises at
    once (fault_trial's gathers every rank's error first, one more collective with the lost rank,
    which would hold this rank for another group timeout)."""
    import torch.distributed as dist

    fault_trial.execute(run, message[0], message[1])
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None)


def setup_children(world: int) -> None:
    """Before any fork: the ranks' world size, our group timeout, our modes, Ray's failure semantics."""

    fault_trial.WORLD = world
    fault_trial._init = init_group
    fault_trial._run_and_gather = run_or_raise
    fault_trial.MODES.update(SAVE_MODES)


def fork_ranks(body, world: int, trial_dir: str, prefix: str, *args) -> list[int]:

    return [
        forks.fork(body, *args[:1], trial_dir, r, *args[1:], log=os.path.join(trial_dir, f"{prefix}_rank_{r}.log"))
        for r in range(world)
    ]


def read_events(trial_dir: str, world: int) -> dict[int, list[oracle.Event]]:
    out = {}
    for rank in range(world):
        path = os.path.join(trial_dir, f"events_rank_{rank}.log")
        with open(path) if os.path.exists(path) else open(os.devnull) as f:
            out[rank] = oracle.parse_events(f.read())
    return out


def resume(mode: str, trial_dir: str, keep: int | None, world: int) -> oracle.Resume:

    pids = fork_ranks(fault_trial.checker, world, trial_dir, "check", mode, keep)
    ended = wait_until(pids, time.monotonic() + 120.0)
    hung = [p for p, t in ended.items() if t is None]
    if hung:
        end(hung)
    compared = fault_trial.compared_contents(mode)
    result_path = os.path.join(trial_dir, "resume_result.json")
    if hung or not os.path.exists(result_path):
        return oracle.Resume(None, f"resume process died ({'hung' if hung else 'no result'})", {}, compared)
    with open(result_path) as f:
        result = json.load(f)
    hashes = {}
    for rank in range(world):
        path = os.path.join(trial_dir, f"resume_hash_rank_{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                hashes[rank] = json.load(f)
    return oracle.Resume(result["step"] or None, result["error"], hashes, compared)


# --------------------------------------------------------------------------- save trials


def calibrate(mode: str, world: int, work: str, keep: int | None) -> dict:
    """An uncut run of KILL_STEPS saves: the time from a save's start to its commit, and a resume
    that must be exact."""

    trial_dir = forks.fresh_dir(os.path.join(work, f"{mode}@ws{world}", "calibration"))
    pids = fork_ranks(rank_saver, world, trial_dir, "save", mode, keep, KILL_STEPS)
    ended = wait_until(pids, time.monotonic() + 120.0)
    if any(t is None for t in ended.values()):
        end([p for p, t in ended.items() if t is None])
        raise RuntimeError(f"{mode} ws{world}: the uncut run hung; see {trial_dir}")
    events = read_events(trial_dir, world)
    rec = oracle.build_record(events)
    outcome, why = oracle.classify(rec, resume(mode, trial_dir, keep, world))
    if outcome != "exact":
        raise RuntimeError(f"{mode} ws{world}: the uncut run does not resume exactly ({why}); see {trial_dir}")
    begun = {e.step: e.t for e in events[0] if e.kind == "save-begin"}
    commit_s = [e.t - begun[e.step] for e in events[0] if e.kind == "committed" and e.step in begun]
    shutil.rmtree(trial_dir, ignore_errors=True)
    return {"save_to_commit_s": oracle.quantiles(commit_s)[2]}


def save_trial(
    mode: str,
    world: int,
    fault: str,
    work: str,
    index: int,
    rng: random.Random,
    window: float,
    keep: int | None,
    at: str = "random",
) -> dict:

    timeout = TIMEOUT_S[0]
    where = "_at_commit" if at == AT_COMMIT else ""
    trial_dir = forks.fresh_dir(os.path.join(work, f"{mode}@ws{world}", f"{fault}{where}_{index:03d}"))
    victim = rng.randrange(world)
    step = rng.randint(1, KILL_STEPS)
    delay = rng.uniform(0.0, window)
    then = "kill" if index % 2 else "cont"  # a stalled rank is resumed or killed afterwards
    targeted = at == AT_COMMIT
    if targeted:  # each rank in turn: a kill starts at rank 0 (the one that wrote the manifest), a stall at rank 1
        victim = (index + (fault == "stall")) % world
    ARMED[0] = (victim, step) if targeted else None
    try:
        pids = fork_ranks(rank_saver, world, trial_dir, "save", mode, keep, STEPS)
    finally:
        ARMED[0] = None
    t_ready = forks.wait_save_begin(trial_dir, pids, step)
    if targeted:
        stopped = wait_stopped(pids[victim])
        if stopped is None:
            end(pids)
            raise RuntimeError(f"{mode} ws{world}: rank {victim} never reached step {step}'s commit; see {trial_dir}")
        t_fault = stopped
        if fault == "kill":
            os.kill(pids[victim], signal.SIGKILL)
    else:
        time.sleep(max(0.0, t_ready + delay - time.monotonic()))
        t_fault = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    survivors = [p for i, p in enumerate(pids) if i != victim]
    ended = wait_until(survivors, t_fault + timeout + SLACK_S)
    hung = [p for p, t in ended.items() if t is None]
    if fault == "stall":
        with_signal(pids[victim], signal.SIGCONT if then == "cont" else signal.SIGKILL)
    victim_end = wait_until([pids[victim]], time.monotonic() + timeout + SLACK_S)[pids[victim]]
    stuck = hung + ([pids[victim]] if victim_end is None else [])
    if stuck:
        end(stuck)
    orphans = reap_orphans(set())
    root = os.path.join(trial_dir, "ckpt")
    locks = held_locks(root)
    events = read_events(trial_dir, world)
    rec = oracle.build_record(events)
    found = rel.leftovers(root)
    res = resume(mode, trial_dir, keep, world)
    resumed, why = oracle.classify(rec, res)
    orphans += reap_orphans(set())
    named = named_ranks([os.path.join(trial_dir, f"save_rank_{r}.log") for r in range(world) if r != victim])
    partial = rel.tracker_names_uncommitted(mode, found) or resumed == "loaded-partial"
    if hung:
        outcome = "hung"
    elif orphans or locks:
        outcome = "orphan"
    elif partial:
        outcome = "committed-partial"
    elif resumed in oracle.BAD:
        outcome = "wrong-resume"
    else:
        outcome = "exact" if resumed == "exact" else "clean"
    ends = [t - t_fault for t in ended.values() if t is not None]
    trial = {
        "trial": index,
        "fault": fault,
        "then": then if fault == "stall" else None,
        "victim": victim,
        "step": step,
        "at": at,
        "fault_after_save_begin_s": round(t_fault - t_ready, 4),
        "in_save": in_save(events, [r for r in range(world) if r != victim], t_fault, mode),
        "phase_rank0": oracle.phase_at(events[0], t_fault),
        "phase_victim": oracle.phase_at(events[victim], t_fault),
        "survivors_end_s": round(max(ends), 2) if ends else None,
        "victim_ended": victim_end is not None,
        "named": victim in named,
        "named_ranks": sorted(named),
        "orphans": orphans,
        "locks_held": locks,
        "last_committed": rec.last_committed,
        "loaded": res.step or 0,
        "resume": resumed,
        "why": why,
        "tracker": found["tracker"],
        "outcome": outcome,
    }
    return keep_or_remove(trial, trial_dir)


def in_save(events: list[list[oracle.Event]], survivors: list[int], t: float, mode: str) -> bool:
    """Whether a surviving rank was inside a save at `t`: its save call begun and, for slimckpt's tier,
    that save's commit not yet known to it (an async write goes on after the call returns); for verl's
    own save, the call not yet returned. A fault anywhere else (the next step's training, the worker
    group's own calls, or rank 0's tracker write once the others have left the save) fails the
    survivors in a collective that is not a save's, with the backend's own error."""
    end = "commit-done" if mode.startswith("incremental") else "save-call-done"
    for rank in survivors:
        began = sum(e.kind == "save-call" and e.t <= t for e in events[rank])
        ended = sum(e.kind == end and e.t <= t for e in events[rank])
        if began > ended:
            return True
    return False


# --------------------------------------------------------------------------- merge trials


# --------------------------------------------------------------------------- campaign


def campaign(
    modes: list[str],
    worlds: list[int],
    kills: int,
    stalls: int,
    seed: int,
    work: str,
    keep: int,
    out: str | None,
    window_s: float | None = None,
    at_commit: int = 0,
) -> dict:

    rng = random.Random(seed)
    result: dict = {
        "kills_per_mode": kills,
        "stalls_per_mode": stalls,
        "at_commit_per_world": at_commit,
        "world_sizes": worlds,
        "seed": seed,
        "timeout_s": TIMEOUT_S[0],
        "slack_s": SLACK_S,
        "keep": keep,
        "modes": {},
    }
    become_subreaper()
    for mode in modes:
        t0 = time.monotonic()
        entry: dict = {"mode": mode, "trials": [], "calibration": {}}
        fixture = None
        if mode == "merge":
            setup_children(2)  # the fixture is a world-size-2 verl checkpoint (reliability_merge.merge_fixture)
            fixture = rel_merge.merge_fixture(work)
        for wi, world in enumerate(worlds):
            # kills and stalls shared out over the world sizes (the first gets the remainder)
            n_kill = kills // len(worlds) + (kills % len(worlds) if wi == 0 else 0)
            n_stall = stalls // len(worlds) + (stalls % len(worlds) if wi == 0 else 0)
            setup_children(world)
            try:
                if mode == "merge":
                    cal = merge_calibration(world, work, fixture)
                    window = 1.15 * cal["output_to_commit_s"]
                    reference = cal.pop("reference")
                elif window_s is not None:
                    cal, window = {"skipped": True}, window_s
                else:
                    cal = calibrate(mode, world, work, keep)
                    window = WINDOW_FACTOR * cal["save_to_commit_s"]
            except RuntimeError as exc:
                entry.setdefault("errors", []).append(str(exc))
                print(f"{mode} ws{world}: {exc}", flush=True)
                continue
            entry["calibration"][f"ws{world}"] = {**cal, "window_s": window}
            plan = [("kill", i, "random") for i in range(n_kill)] + [("stall", i, "random") for i in range(n_stall)]
            if mode.startswith("incremental"):  # only slimckpt's commit has an outcome to learn
                plan += [(f, i, AT_COMMIT) for f in ("kill", "stall") for i in range(at_commit)]
            for fault, i, at in plan:
                if mode == "merge":
                    trial = merge_trial(world, fault, work, fixture, i, rng, window, reference)
                else:
                    try:
                        trial = save_trial(mode, world, fault, work, i, rng, window, keep, at)
                    except RuntimeError as exc:  # the fault never landed: not a trial
                        entry.setdefault("errors", []).append(str(exc))
                        print(f"{mode} ws{world} {fault} {i}: {exc}", flush=True)
                        continue
                trial["world"] = world
                entry["trials"].append(trial)
                print(
                    f"{mode} ws{world} {fault} {i}{' at the commit outcome' if at == AT_COMMIT else ''}: "
                    f"{trial['outcome']} (victim {trial['victim']}, named "
                    f"{trial['named']}, survivors ended {trial['survivors_end_s']} s)",
                    flush=True,
                )
        entry["summary"] = summarize(entry["trials"])
        entry["seconds"] = round(time.monotonic() - t0, 1)
        result["modes"][mode] = entry
        if out:
            with open(out, "w") as f:
                json.dump({**result, "partial": True}, f, indent=1)
    return result


# --------------------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--kills", type=int, default=30, help="single-rank SIGKILLs per mode, over all world sizes (30)")
    p.add_argument("--stalls", type=int, default=10, help="single-rank stalls per mode, over all world sizes (10)")
    p.add_argument("--trials", type=int, default=None, help="shorthand: N kills and max(1, N // 3) stalls per mode")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3], help="world sizes (default 2 3)")
    p.add_argument("--timeout", type=float, default=20.0, help="the ranks' process group timeout, s (default 20)")
    p.add_argument("--keep", type=int, default=2, help="trainer.max_actor_ckpt_to_keep (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=os.path.join(REPO, "runs", "rank_faults"))
    p.add_argument("--json", default=OUT, help=f"results (default {os.path.relpath(OUT, REPO)})")
    p.add_argument(
        "--window",
        type=float,
        default=None,
        help="save modes: faults within this many s of a save's start, with no calibration run (default: "
        "1.3x the calibrated save-to-commit time, and the uncut run must resume exactly)",
    )
    p.add_argument(
        "--at-commit",
        type=int,
        default=1,
        help="slimckpt's save modes: per world size, this many more kills and as many stalls placed once rank 0 "
        "has written the manifest that completes a step, before the ranks know the commit's outcome (default 1)",
    )
    p.add_argument("--keep-dirs", action="store_true", help="keep every trial's dir (default: the bad ones)")
    p.add_argument("--render", action="store_true", help="print the report section of --json and exit")
    args = p.parse_args(argv)
    if args.render:
        with open(args.json) as f:
            print(render(json.load(f)))
        return 0
    if args.trials is not None:
        args.kills, args.stalls = args.trials, max(1, args.trials // 3)
    TIMEOUT_S[0], KEEP_ALL[0] = args.timeout, args.keep_dirs

    rel.quiet_imports()  # torch, transformers and verl imported once, before any fork
    import torch
    import verl

    os.makedirs(args.work, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    source, provenance = rel.source_note(), rel.source_commit()  # before any trial: what the trials run
    t0 = time.monotonic()
    data = campaign(
        args.modes,
        args.worlds,
        args.kills,
        args.stalls,
        args.seed,
        args.work,
        args.keep,
        args.json,
        args.window,
        args.at_commit,
    )
    data["seconds"] = round(time.monotonic() - t0, 1)
    data["command"] = "python -m scripts.faults.ranks " + " ".join(argv if argv is not None else sys.argv[1:])
    data["machine"] = {"cpus": os.cpu_count(), "torch": torch.__version__, "verl": verl.__version__}
    data["source"] = source
    data.update(provenance)
    with open(args.json, "w") as f:
        json.dump(data, f, indent=1)
    print(render(data))
    # a world size whose calibration failed ran none of its trials: the campaign did not run what it says
    ran_all = not any(e.get("errors") for e in data["modes"].values())
    return (
        0 if ran_all and all(e["summary"]["bad"] == 0 for m, e in data["modes"].items() if m != "verl-default") else 1
    )


if __name__ == "__main__":
    sys.exit(main())
