"""The rank campaign's merge trials: `slimckpt merge --distributed_merge` under torchrun over the SIGKILL campaign's
fixture, one worker killed or stopped at a random moment of the merge, then what the survivors did (ended within
the group's timeout, named the lost rank), what the target holds, and whether a rerun over it succeeds.
ranks.py's campaign runs them beside the save trials."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time

from scripts.faults import forks, oracle
from scripts.faults import reliability_merge as rel_merge
from scripts.faults.forks import (
    held_locks,
    named_ranks,
    proc_children,
    proc_state,
    reap_orphans,
    with_signal,
)
from scripts.faults.ranks_settings import SLACK_S, TIMEOUT_S, keep_or_remove

# lazy imports: slimckpt loads after reliability.quiet_imports() set the environment it reads, before the forks


def torchrun(world: int, fixture: str, target: str, log: str, overwrite: bool = False) -> subprocess.Popen:
    import slimckpt

    source = os.path.dirname(os.path.dirname(os.path.abspath(slimckpt.__file__)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": "1",
        "SLIMCKPT_MERGE_PEER_TIMEOUT": str(TIMEOUT_S[0]),
    }
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        "-m",
        "slimckpt.cli",
        "merge",
        "--local_dir",
        fixture,
        "--target_dir",
        target,
        "--distributed_merge",
        "--no_progress",
    ] + (["--overwrite"] if overwrite else [])
    out = open(log, "ab")
    try:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    finally:
        out.close()


def workers_of(agent: int) -> dict[int, int]:
    """RANK -> pid of torchrun's workers (children of its agent)."""
    out = {}
    for pid, _ in proc_children(agent):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            out[int(env[b"RANK"])] = pid
    return out


def merge_calibration(world: int, work: str, fixture: str) -> dict:
    from slimckpt.layout.merge_manifest import partial_path

    trial_dir = forks.fresh_dir(os.path.join(work, f"merge@ws{world}", "calibration"))
    target = os.path.join(trial_dir, "out")
    t0 = time.monotonic()
    proc = torchrun(world, fixture, target, os.path.join(trial_dir, "merge.log"))
    appeared = committed = None
    while proc.poll() is None:
        if appeared is None and (os.path.exists(partial_path(target)) or os.path.exists(target)):
            appeared = time.monotonic()
        if committed is None and os.path.exists(target):
            committed = time.monotonic()
        time.sleep(0.002)
    if proc.returncode != 0 or appeared is None or not rel_merge.looks_complete("merge", target):
        raise RuntimeError(
            f"merge ws{world}: an uncut distributed merge failed (exit {proc.returncode}); see {trial_dir}"
        )
    reference = rel_merge.file_hashes(target, skip=("manifest.json",))
    seconds = time.monotonic() - t0
    shutil.rmtree(trial_dir, ignore_errors=True)
    return {
        "merge_s": seconds,
        "output_to_commit_s": (committed or time.monotonic()) - appeared,
        "reference": reference,
    }


def merge_trial(
    world: int,
    fault: str,
    work: str,
    fixture: str,
    index: int,
    rng: random.Random,
    window: float,
    reference: dict[str, str],
) -> dict:
    from slimckpt.layout.merge_manifest import partial_path

    timeout = TIMEOUT_S[0]
    trial_dir = forks.fresh_dir(os.path.join(work, f"merge@ws{world}", f"{fault}_{index:03d}"))
    target = os.path.join(trial_dir, "out")
    log = os.path.join(trial_dir, "merge.log")
    victim = rng.randrange(world)
    delay = rng.uniform(0.0, window)
    then = "kill" if index % 2 else "cont"
    proc = torchrun(world, fixture, target, log)
    while proc.poll() is None and not (os.path.exists(partial_path(target)) or os.path.exists(target)):
        time.sleep(0.002)
    t_out = time.monotonic()
    time.sleep(max(0.0, t_out + delay - time.monotonic()))
    workers = workers_of(proc.pid)
    t_fault = time.monotonic()
    hit = victim in workers and proc.poll() is None
    if hit:
        os.kill(workers[victim], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    deadline = t_fault + timeout + SLACK_S
    survivors = [p for r, p in workers.items() if r != victim]
    while (
        time.monotonic() < deadline
        and proc.poll() is None
        and any(proc_state(p) not in ("Z", "X", None) for p in survivors)
    ):
        time.sleep(0.01)
    alive = [p for p in survivors if os.path.exists(f"/proc/{p}") and proc_state(p) not in ("Z", "X", None)]
    t_end = time.monotonic()
    hung = bool(alive)
    if fault == "stall" and victim in workers:
        with_signal(workers[victim], signal.SIGCONT if then == "cont" else signal.SIGKILL)
    try:
        proc.wait(timeout=timeout + SLACK_S + 30.0)  # torchrun's agent gives its workers 30 s after a SIGTERM
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    orphans = reap_orphans(set())
    locks = held_locks(os.path.dirname(fixture)) + held_locks(trial_dir)
    complete = rel_merge.looks_complete("merge", target)
    correct = complete and rel_merge.target_correct("merge", target, reference)
    rerun = torchrun(world, fixture, target, os.path.join(trial_dir, "rerun.log"), overwrite=True)
    rerun.wait()
    rerun_ok = (
        rerun.returncode == 0
        and rel_merge.looks_complete("merge", target)
        and rel_merge.target_correct("merge", target, reference)
    )
    orphans += reap_orphans(set())
    merged = oracle.classify_merge(complete, correct, correct, rerun_ok)
    named = named_ranks([log])
    if hung:
        outcome = "hung"
    elif orphans or locks:
        outcome = "orphan"
    elif merged == "looks-complete-but-broken":
        outcome = "committed-partial"
    elif merged == "rerun-failed":
        outcome = "wrong-resume"
    else:
        outcome = "exact" if merged == "complete-verified" else "clean"
    trial = {
        "trial": index,
        "fault": fault,
        "then": then if fault == "stall" else None,
        "victim": victim,
        "hit": hit,
        "fault_after_output_s": round(t_fault - t_out, 4),
        "survivors_end_s": round(t_end - t_fault, 2),
        "named": victim in named,
        "named_ranks": sorted(named),
        "orphans": orphans,
        "locks_held": locks,
        "target": "complete" if complete else ("absent" if not os.path.exists(target) else "incomplete"),
        "rerun_ok": rerun_ok,
        "resume": merged,
        "outcome": outcome,
    }
    return keep_or_remove(trial, trial_dir)
