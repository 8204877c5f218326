#!/usr/bin/env python
"""`slimckpt merge` of one checkpoint by two source trees, taking turns: does a change pay?

  python -m scripts.bench.merge_ab --ckpt CKPT/actor --a /old/checkout --b . --pairs 3 --json ab.json
  python -m scripts.bench.merge_ab --render ab.json            # the table again, no runs

Each pair runs A then B, the next B then A (a slow minute of the shared host falls on both), every
merge after the checkpoint's pages were dropped from the page cache. Per merge: the process's wall,
its peak RssAnon (`slimckpt.observe.measure`, sampled every 10 ms) and the writer's own split
(`SLIMCKPT_MERGE_STATS`: the writer's wall, the cast with its page faults, the last writes and
fsyncs). A tree is a checkout: its `patches/` goes first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from slimckpt.observe.measure import evict_from_page_cache, median, run_measured

MiB = 2**20


def one_merge(tree: str, ckpt: str, target: str, extra: list[str]) -> dict:
    shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(f"{target}.partial", ignore_errors=True)
    os.sync()
    evict_from_page_cache([str(p) for p in Path(ckpt).iterdir() if p.is_file()])
    with tempfile.NamedTemporaryFile(suffix=".json") as stats:
        env = {
            "PYTHONPATH": str(Path(tree, "patches")),
            "SLIMCKPT_MERGE_STATS": stats.name,
            "SLIMCKPT_LOG_LEVEL": "WARNING",
            "OMP_NUM_THREADS": "2",
        }
        load = os.getloadavg()[0]
        cmd = [sys.executable, "-m", "slimckpt.cli", "merge", "--local_dir", ckpt, "--target_dir", target]
        res = run_measured([*cmd, "--no_progress", *extra], env=env)
        if res.returncode:
            raise SystemExit(f"[merge-ab] {tree}: the merge failed:\n{res.output[-2000:]}")
        writer = json.loads(Path(stats.name).read_text() or "{}")
    return {"wall_s": res.wall_s, "peak": res.physical_peak, "load": load, "writer": writer}


def run(args: argparse.Namespace) -> dict:
    trees = {"A": args.a, "B": args.b}
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for k in range(args.pairs):
        for name in ("A", "B") if k % 2 == 0 else ("B", "A"):
            got = one_merge(trees[name], args.ckpt, args.target, args.merge_args.split())
            runs[name].append(got)
            print(
                f"[merge-ab] pair {k + 1}/{args.pairs} {name}: {got['wall_s']:.1f} s, "
                f"{got['peak'] / MiB:.0f} MiB (load {got['load']:.1f})",
                flush=True,
            )
    shutil.rmtree(args.target, ignore_errors=True)
    return {
        "command": " ".join(["python -m scripts.bench.merge_ab", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "ckpt": args.ckpt,
        "trees": {
            name: {"path": path, "label": label}
            for (name, path), label in zip(trees.items(), (args.a_label, args.b_label))
        },
        "runs": runs,
    }


def table(result: dict) -> str:
    lines = [
        "| tree | runs | wall (median) | walls | writer (median) | cast (median) | last writes | peak RssAnon | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in result["runs"].items():
        walls = [r["wall_s"] for r in runs]
        writer = [r["writer"].get("wall_s", 0.0) for r in runs]
        cast = [r["writer"].get("cast_s", 0.0) for r in runs]
        close = [r["writer"].get("close_s", 0.0) for r in runs]
        label = result["trees"][name]["label"]
        loads = ", ".join(f"{r['load']:.1f}" for r in runs)
        lines.append(
            f"| {label} | {len(runs)} | {median(walls):.1f} s | {min(walls):.1f}-{max(walls):.1f} s "
            f"| {median(writer):.1f} s | {median(cast):.1f} s | {median(close):.1f} s "
            f"| {max(r['peak'] for r in runs) / MiB:.0f} MiB | {loads} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.merge_ab", description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", help="a checkpoint's role dir that `slimckpt merge --local_dir` takes")
    p.add_argument("--a", help="checkout A (its patches/ is imported)")
    p.add_argument("--b", default=".", help="checkout B (default: this one)")
    p.add_argument("--a-label", default="A", help="how the table names A")
    p.add_argument("--b-label", default="B", help="how the table names B")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--target", default=os.path.join(tempfile.gettempdir(), "merge_ab_out"), help="the merge output")
    p.add_argument("--merge-args", default="", help="more `slimckpt merge` flags, one string")
    p.add_argument("--json", default=None, help="write the runs here")
    p.add_argument("--render", default=None, metavar="JSON", help="print an earlier run's table, no runs")
    args = p.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
    else:
        if not (args.ckpt and args.a):
            p.error("--ckpt and --a are needed for a run (or --render JSON)")
        result = run(args)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
