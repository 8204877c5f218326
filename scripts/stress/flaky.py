"""The tests that once failed without a code change, run again and again beside a CPU load: a guard
that their fixes hold, and the rate to write down when one fails again.

    python -m scripts.stress.flaky --repeats 20                  # make stress-flaky
    python -m scripts.stress.flaky --repeats 5 --only lora       # one of them

Each repeat is its own pytest run of the test (a fresh interpreter, a fresh PYTHONHASHSEED, fresh
ports), with a second process keeping one core busy (`--no-load` turns it off). A failing repeat
keeps the last lines of its output in `--work`; the exit status is 1 if any repeat failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from scripts.provenance import source_commit
from scripts.stress import cpu_load

REPO = Path(__file__).resolve().parents[2]

# name -> (pytest node ids, what once failed and the commit that fixed it)
GUARDS: dict[str, tuple[list[str], str]] = {
    "lora": (
        ["tests/merge/test_merge_lora.py"],
        "adapter_config.json's target_modules order followed PYTHONHASHSEED (be0785c)",
    ),
    "rank_faults": (
        ["tests/e2e/test_rank_faults.py::test_one_rank_killed_or_stalled_mid_save"],
        "a commit-outcome stall that landed before the step's commit: before rank 0 had its last collective's "
        "part (4e35883), or, in the async modes, before the actor's commit on its own thread (423194a)",
    ),
    "stream_offload": (
        [
            "tests/save/test_stream_offload.py::"
            "test_stream_under_offload_through_verl_equals_sync_resumes_and_holds_sync_level_memory"
        ],
        "the paused read's tensor stayed alive when the writer paused before the offload (2b4f57c)",
    ),
    "exit_abort": (
        ["tests/dist/test_heartbeat.py"],
        "the heartbeat thread inside a store call at interpreter exit aborted the process (ef8c93f)",
    ),
    "merge_bytes": (
        [
            "tests/merge/test_verl_merger.py::test_workers_and_ranks_give_identical_bytes",
            "tests/merge/test_merge_moe.py::test_distributed_merge_and_verl_redirect",
        ],
        "a distributed merge's directory once differed from the single merge's (make stress-merge shakes it)",
    ),
}


def run_once(nodes: list[str], log: Path) -> tuple[bool, float]:
    env = {**os.environ, "PYTHONHASHSEED": str(random.randrange(1, 2**31))}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodes],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        log.write_text(f"PYTHONHASHSEED={env['PYTHONHASHSEED']}\n{proc.stdout[-20000:]}\n{proc.stderr[-5000:]}")
    return proc.returncode == 0, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.stress.flaky", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=20, help="runs of each guarded test (default 20)")
    parser.add_argument("--only", action="append", choices=sorted(GUARDS), help="these guards only (repeatable)")
    parser.add_argument("--no-load", action="store_true", help="no second process loading the CPU")
    parser.add_argument("--work", type=Path, default=Path("runs/stress_flaky"), help="logs of failing repeats")
    parser.add_argument("--json", type=Path, help="write the counts here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    args.work.mkdir(parents=True, exist_ok=True)
    counts: dict[str, dict] = {}
    with cpu_load(not args.no_load):
        for name in args.only or list(GUARDS):
            nodes, why = GUARDS[name]
            failed, walls = 0, []
            for k in range(args.repeats):
                ok, seconds = run_once(nodes, args.work / f"{name}_{k:02d}.log")
                failed += not ok
                walls.append(seconds)
                print(f"[{name} {k + 1}/{args.repeats}] {'ok' if ok else 'FAILED'} {seconds:.0f} s", flush=True)
            counts[name] = {"failed": failed, "runs": args.repeats, "median_s": sorted(walls)[len(walls) // 2]}
            print(f"{name}: {failed} of {args.repeats} failed ({why})", flush=True)
    if args.json:
        args.json.write_text(
            json.dumps({"commit": source_commit(), "cpu_load": not args.no_load, "guards": counts}, indent=1) + "\n"
        )
    return 1 if any(c["failed"] for c in counts.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
