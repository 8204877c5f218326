#!/usr/bin/env python
"""make quickstart: verl 0.9.1's own PPO trainer (GRPO) on a tiny built-in model on CPU, twice:
with verl's default checkpoint settings and with `+recipe=quickstart`, saving every step; then a
side-by-side table of what the recipe changed.

  make quickstart                       # 3 steps each, 2 ranks, wandb offline under runs/quickstart
  python -m scripts.quickstart --steps 5 --ranks 1
  WANDB_MODE=online make quickstart     # upload the two runs

Each save is measured inside verl's workers (SLIMCKPT_MEASURE=1): peak anonymous RSS above the
rank's level before the save, seconds, bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from scripts.provenance import source_commit

REPO = Path(__file__).resolve().parent.parent

RUNS = {
    "verl defaults": [],
    "+recipe=quickstart": ["+recipe=quickstart"],
}


def run_one(name: str, extra: list[str], out: Path, steps: int, ranks: int) -> dict:
    run_dir = out / name.replace("+", "").replace("=", "_").replace(" ", "_")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    metrics = run_dir / "save_metrics.jsonl"
    ckpt = run_dir / "checkpoints"
    env = {
        **os.environ,
        "SLIMCKPT_MEASURE": "1",
        "SLIMCKPT_METRICS_FILE": str(metrics),
        "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
        "WANDB_DIR": str(run_dir),
        "NPROC": str(ranks),
        # the quickstart is the CPU demo, also on a machine that has a GPU
        "SLIMCKPT_CPU_FORCE": "1",
    }
    cmd = [
        "bash",
        str(REPO / "scripts" / "train_small.sh"),
        *extra,
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={ckpt}",
        "trainer.project_name=slimckpt-quickstart",
        f"trainer.experiment_name={run_dir.name}",
        "trainer.logger=[console,wandb]",
    ]
    print(f"\n[quickstart] {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(run_dir / "train.log", "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (run_dir / "train.log").read_text()[-4000:]
        raise SystemExit(
            f"[quickstart] the '{name}' run failed (exit {proc.returncode}); log: {run_dir / 'train.log'}\n{tail}"
        )
    print(f"[quickstart] {name}: done in {seconds:.0f} s (log {run_dir / 'train.log'})", flush=True)
    return summarize(name, run_dir, ckpt, metrics, seconds)


def summarize(name: str, run_dir: Path, ckpt: Path, metrics: Path, seconds: float) -> dict:
    # sync saves only here: each one's "save" report is complete (an async save adds a "commit" one)
    records = [
        r
        for r in (json.loads(line) for line in metrics.read_text().splitlines() if line.strip())
        if r.get("kind", "save") == "save"
    ]
    if not records:
        raise SystemExit(f"[quickstart] no save metrics in {metrics}: did the run save a checkpoint?")
    steps = sorted({r["global_step"] for r in records})
    # verl's retention deletes a step's actor/ (and critic/) dir but leaves its data.pt behind.
    step_dirs = [ckpt / f"global_step_{s}" for s in steps if (ckpt / f"global_step_{s}" / "actor").is_dir()]
    sizes = [sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) for d in step_dirs]
    actor = [r for r in records if r["role"] == "actor"]
    per_step_seconds = [max(r["seconds"] for r in actor if r["global_step"] == s) for s in steps]
    ranks = sorted({r["rank"] for r in actor})
    peak_per_rank = {rank: max(r["peak_rss_extra_bytes"] for r in actor if r["rank"] == rank) for rank in ranks}
    wandb_runs = sorted(str(p) for p in run_dir.glob("wandb/*run-*"))
    return {
        "name": name,
        "run_seconds": seconds,
        "save_contents": actor[0]["save_contents"],
        "checkpoint_bytes": median(sizes) if sizes else 0,
        "checkpoints_kept": len(step_dirs),
        "save_seconds": median(per_step_seconds),
        "peak_rss_extra_per_rank": peak_per_rank,
        "wandb": wandb_runs[0] if wandb_runs else "(no wandb run found)",
        "log": str(run_dir / "train.log"),
    }


def table(rows: list[dict], wandb: bool = True) -> str:
    ranks = sorted({k for r in rows for k in r["peak_rss_extra_per_rank"]})
    header = ["", *[r["name"] for r in rows]]
    body = [
        ["actor save_contents", *[",".join(r["save_contents"]) for r in rows]],
        ["bytes on disk per checkpoint (median)", *[f"{r['checkpoint_bytes'] / 2**20:.2f} MiB" for r in rows]],
        ["checkpoints kept at the end (actor/)", *[str(r["checkpoints_kept"]) for r in rows]],
        ["actor save seconds (median, slowest rank)", *[f"{r['save_seconds']:.2f} s" for r in rows]],
        *[
            [
                f"peak extra host RSS of the save, rank {k}",
                *[f"{r['peak_rss_extra_per_rank'].get(k, 0) / 2**20:.1f} MiB" for r in rows],
            ]
            for k in ranks
        ],
        ["whole run", *[f"{r['run_seconds']:.0f} s" for r in rows]],
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    fmt = lambda line: "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |"  # noqa: E731
    out = [fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, body)]
    if wandb:
        out.append("")
        out += [f"wandb ({r['name']}): {r['wandb']}" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (a save after each)")
    parser.add_argument("--ranks", type=int, default=2, help="FSDP ranks (CPU processes) per run")
    parser.add_argument("--out", default=str(REPO / "runs" / "quickstart"), help="where runs, checkpoints, wandb go")
    parser.add_argument(
        "--doc",
        default=str(REPO / "docs" / "quickstart.md"),
        help="the committed copy of the table, with the commit and machine it ran on ('' for none)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    load_before = os.getloadavg()[0]
    rows = [run_one(name, extra, out, args.steps, args.ranks) for name, extra in RUNS.items()]
    text = table(rows)
    (out / "summary.md").write_text(text + "\n")
    if args.doc:
        Path(args.doc).write_text(provenance(args, load_before) + "\n\n" + table(rows, wandb=False) + "\n")
    print("\n" + text)
    print(
        f"\n(table saved to {out / 'summary.md'}{' and ' + args.doc if args.doc else ''}; "
        f"`wandb sync <dir>` uploads an offline run)"
    )
    return 0


def provenance(args: argparse.Namespace, load_before: float) -> str:
    """Which code and machine the table comes from: the commit (and whether the tree was dirty)."""
    commit = source_commit(short=12)

    return (
        f"# make quickstart\n\nProduced by `make quickstart` (`python -m scripts.quickstart --steps {args.steps} "
        f"--ranks {args.ranks}`) on commit {commit}, {time.strftime('%Y-%m-%d')}; {platform.machine()}, "
        f"{os.cpu_count()} cores, 1-minute load average {load_before:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end. Both runs are verl 0.9.1's `main_ppo` (GRPO, tiny model, CPU) with "
        f"`SLIMCKPT_MEASURE=1`, which only times verl's save and samples its RSS (verl's own retention, tracker "
        f"and load run in the 'verl defaults' column)."
    )


if __name__ == "__main__":
    sys.exit(main())
