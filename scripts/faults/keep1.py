"""The uncut run of `make faults` (scripts/faults/reliability.py's calibration: verl's PPOTrainer
_save_checkpoint over two FSDP2 ranks, async incremental saves, max_actor_ckpt_to_keep=1) with the
tracker's watcher made to look late: its first look at step N waits until retention has deleted
step N's actor dir, which happens once step N+1 committed. That is the race `make faults` lost at
random, made certain. Prints one JSON line: the calibration's result and, per step, whether
the watcher's first look found the actor dir gone.

Usage: python -m scripts.faults.keep1 WORK_DIR [MODE]   (MODE: incremental-async, the default, or
incremental-stream: the same with async_save=stream)"""

from __future__ import annotations

import json
import os
import sys
import time

# lazy imports: the campaign and slimckpt load after the environment they read is set
# the next step commits about a second later; past 60 s it never will, and the look goes on
LATE_LOOK_LIMIT_S = 60.0


def install_late_look(record: str, last_step: int) -> None:
    from slimckpt.save.driver.tracker import CommitWatcher

    original = CommitWatcher._committed
    looked: set[int] = set()

    def _committed(self, step, roles):
        if step < last_step and step not in looked:
            looked.add(step)
            actor = os.path.join(self.root, f"global_step_{step}", "actor")
            deadline = time.monotonic() + LATE_LOOK_LIMIT_S
            while os.path.isdir(actor) and time.monotonic() < deadline:
                # a 20 ms poll: the look goes on soon after the delete at little CPU cost
                time.sleep(0.02)
            with open(record, "a") as f:
                f.write(json.dumps({"step": step, "actor_gone": not os.path.isdir(actor)}) + "\n")
        return original(self, step, roles)

    CommitWatcher._committed = _committed


def main(work: str, mode: str = "incremental-async") -> None:
    os.environ.setdefault("SLIMCKPT_LOG_LEVEL", "ERROR")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from scripts.faults import reliability  # torch, transformers and verl imported once, before the forks

    os.makedirs(work, exist_ok=True)
    record = os.path.join(work, "late_looks.jsonl")
    install_late_look(record, reliability.CALIBRATION_STEPS)
    result: dict = {}
    try:
        result["calibration"] = reliability.calibrate(mode, work, keep=1)
    except RuntimeError as exc:
        result["error"] = str(exc)
    with open(record) if os.path.exists(record) else open(os.devnull) as f:
        result["late_looks"] = [json.loads(line) for line in f if line.strip()]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
