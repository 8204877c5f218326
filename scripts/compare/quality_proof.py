#!/usr/bin/env python3
"""Show that slimckpt's recipes leave training unchanged: verl's own trainer on the tiny model on
CPU (scripts/train_small.sh), one algorithm at a time, N steps with validation every few steps:

  default            verl's defaults (no recipe; its own save: model + optimizer + extra)
  <recipe>           each recipe in recipes/, otherwise identical
  <recipe>_resume    the same, stopped after step K (trainer.total_training_steps=K), then started
                     again with trainer.resume_mode=auto up to step N
  <recipe>_sigkill   (--sigkill RECIPE) a run to N whose whole process tree (Ray included) gets
                     SIGKILL once step K+2 has logged its metrics (and wandb's file holds every
                     step up to the checkpoint it will resume from: see kill_now), then resumed
                     with resume_mode=auto from its last committed checkpoint up to step N

Every run saves every --save-freq steps and validates every --test-freq steps, logs to wandb
offline (runs/compare/<algo>/<variant>/wandb) and gets the ckpt/* save metrics. Then
scripts/compare/runs.py draws docs/compare_<algo>.png and writes docs/compare_<algo>.md (the
table, "identical" where a curve equals verl's defaults bit for bit).

The policy starts warm: `python -m slimckpt_testing.tiny --warmup-steps S` (a few seconds of supervised
steps on the addition task, built once into runs/tiny_assets and reused) leaves the tiny model
right about a third of the time (greedy validation ~0.3), so the RL curves rise visibly within
the run. Every run validates before its first step (trainer.val_before_train=true), a resumed one
at the step it resumed from.

A variant whose run already finished with the same settings (its `done` marker holds them) is not
run again unless --force, so a second call only redraws. --jobs runs that many variants side by
side (each is its own Ray cluster; the runs are seeded, so the curves do not depend on it).
`make compare` runs grpo (with a SIGKILL run of incremental), flowrl and ppo.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from scripts.provenance import source_commit
from slimckpt.observe.wandb_history import HistoryError, RunHistory, read_offline_run, run_dirs
from slimckpt.verl.recipes import list_recipes

# lazy imports: psutil and tqdm load where runs are watched or killed; the plan and the report need neither

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "scripts" / "train_small.sh"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="quality_proof.py",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--algo", default="grpo", choices=["grpo", "flowrl", "ppo"], help="default: %(default)s")
    p.add_argument("--steps", type=int, default=20, help="training steps N (default: %(default)s)")
    p.add_argument("--stop-at", type=int, default=10, help="step K after which resume runs stop (default: %(default)s)")
    p.add_argument("--save-freq", type=int, default=5, help="default: %(default)s")
    p.add_argument("--test-freq", type=int, default=5, help="default: %(default)s")
    p.add_argument("--recipes", default=None, help="comma-separated recipes (default: every recipes/*.yaml)")
    p.add_argument("--no-resume", action="store_true", help="skip the <recipe>_resume runs")
    p.add_argument("--sigkill", default="", help="comma-separated recipes that also get a SIGKILL + resume run")
    p.add_argument("--work", default=str(REPO / "runs" / "compare"), help="run directory (default: %(default)s)")
    p.add_argument("--docs", default=str(REPO / "docs"), help="where the PNG and table go (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="run variants again even if they finished before")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per training run (default: %(default)s)")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=150,
        help="supervised warm-up steps of the tiny model before RL (python -m slimckpt_testing.tiny; "
        "default: %(default)s; 0: random weights)",
    )
    p.add_argument("--max-operand", type=int, default=4, help="the task's a+b= use 0..this (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=2, help="variants run side by side (default: %(default)s)")
    return p.parse_args(argv)


def recipes(arg: str | None) -> list[str]:
    if arg:
        return [r for r in arg.split(",") if r]
    return [o.name for o in list_recipes()]


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process it started (Ray's included), by pid."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)


def wandb_steps(wandb_dir: str | None) -> set[int]:
    """The steps whose training metrics the newest offline wandb run below wandb_dir has in its file."""
    runs = run_dirs(wandb_dir) if wandb_dir and os.path.isdir(wandb_dir) else []
    if not runs:
        return set()
    history = RunHistory("killed")
    try:
        read_offline_run(runs[-1], history)
    except HistoryError:
        return set()
    return {step for step, row in history.rows.items() if "training/global_step" in row}


def committed_step(ckpt_dir: Path | None) -> int | None:
    """The step verl resumes from: its tracker file, latest_checkpointed_iteration.txt."""
    try:
        return int((ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip())
    except (OSError, ValueError, TypeError):
        return None


def console_step(text: str) -> int:
    """The last training step whose metrics line the console shows (0 before the first)."""
    return max((int(m) for m in re.findall(r"step:(\d+) - global_seqlen", text)), default=0)


def kill_now(text: str, kill_at_step: int, ckpt_dir: Path | None, wandb_dir: str | None) -> bool:
    """Whether to SIGKILL: the console has shown the kill step, and wandb's run file already holds
    every step up to the checkpoint the run would resume from. wandb writes its file a block at a
    time, steps behind the console, and a SIGKILL loses what it has not written: killed any earlier,
    the steps between its last write and the checkpoint would be missing from the curve while the
    checkpoint has them (the resumed run logs only the steps after it)."""
    if console_step(text) < kill_at_step:
        return False
    resume_from = committed_step(ckpt_dir)
    if resume_from is None:
        return True
    logged = wandb_steps(wandb_dir)
    return all(step in logged for step in range(1, resume_from + 1))


KILL_NOTE = "[quality_proof] SIGKILL sent to the whole process tree after step"


def train(
    log: Path,
    overrides: list[str],
    env: dict,
    timeout: int,
    kill_at_step: int | None = None,
    ckpt_dir: Path | None = None,
) -> None:
    """One train_small.sh run; raise with the log's tail on failure. With kill_at_step, SIGKILL
    the whole process tree at the first moment kill_now allows (ckpt_dir: the run's checkpoints),
    and return."""
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["bash", str(TRAIN), *overrides]
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
        start = time.time()
        try:
            while proc.poll() is None:
                if time.time() - start > timeout:
                    _kill_tree(proc)
                    raise RuntimeError(f"{log}: no result after {timeout} s (killed)")
                text = log.read_text(errors="replace") if kill_at_step is not None else ""
                if kill_at_step is not None and kill_now(text, kill_at_step, ckpt_dir, env.get("WANDB_DIR")):
                    _kill_tree(proc)
                    with open(log, "a") as note:
                        note.write(f"\n{KILL_NOTE} {console_step(text)}\n")
                    return
                time.sleep(2)
        except BaseException:
            _kill_tree(proc)
            raise
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"{log}: train_small.sh exited {proc.returncode}\n{tail}")


def run_env(args: argparse.Namespace) -> dict:
    """The environment of every train_small.sh run (TINY_ASSETS added once they are built)."""
    env = {**os.environ, "WANDB_MODE": "offline", "RAY_DEDUP_LOGS": "0"}
    env.pop("RAY_ADDRESS", None)
    # train_small.sh rebuilds TINY_ASSETS unless its tiny.json names the same inputs: give it them
    env.update(TINY_WARMUP_STEPS=str(args.warmup_steps), TINY_MAX_OPERAND=str(args.max_operand))
    return env


def build_assets(args: argparse.Namespace, env: dict) -> Path:
    """The warm-started tiny model and its data, built once (reused while their inputs match)."""
    name = f"llama-op{args.max_operand}-warm{args.warmup_steps}"
    out = REPO / "runs" / "tiny_assets" / name
    subprocess.run(
        [
            sys.executable,
            "-m",
            "slimckpt_testing.tiny",
            "--out",
            str(out),
            "--reuse",
            "--warmup-steps",
            str(args.warmup_steps),
            "--max-operand",
            str(args.max_operand),
        ],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    return out


def plan_variants(args: argparse.Namespace, names: list[str], sigkill: list[str]) -> list[tuple]:
    """(variant, recipe or None, [(log name, extra overrides, kill step)]) in the order they are drawn."""
    full = [f"trainer.total_training_steps={args.steps}"]
    plan = [("default", None, [("train", full, None)])]
    for r in names:
        plan.append((r, r, [("train", full, None)]))
        resume = [("train_resumed", [*full, "trainer.resume_mode=auto"], None)]
        if not args.no_resume:
            plan.append(
                (f"{r}_resume", r, [("train_first", [f"trainer.total_training_steps={args.stop_at}"], None), *resume])
            )
        if r in sigkill:
            plan.append((f"{r}_sigkill", r, [("train_killed", full, args.stop_at + 2), *resume]))
    return plan


def run_variant(
    variant: str,
    recipe: str | None,
    runs: list,
    common: list[str],
    work: Path,
    base_env: dict,
    args: argparse.Namespace,
) -> None:
    vdir = work / variant
    done = vdir / "done"
    settings = json.dumps({"common": common, "recipe": recipe, "runs": runs}, sort_keys=True)
    if not args.force and done.exists() and done.read_text().splitlines()[1:] == [settings]:
        return
    if vdir.exists():
        shutil.rmtree(vdir)
    vdir.mkdir(parents=True)
    env = {**base_env, "WANDB_DIR": str(vdir)}
    for log_name, extra, kill_step in runs:
        overrides = [
            *common,
            *([f"+recipe={recipe}"] if recipe else []),
            f"trainer.default_local_dir={vdir / 'checkpoints'}",
            f"trainer.experiment_name={args.algo}_{variant}",
            *extra,
        ]
        train(
            vdir / f"{log_name}.log",
            overrides,
            env,
            args.timeout,
            kill_at_step=kill_step,
            ckpt_dir=vdir / "checkpoints",
        )
    done.write_text(time.strftime("%Y-%m-%d %H:%M:%S\n") + settings + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not 0 < args.stop_at < args.steps:
        print(f"quality_proof.py: --stop-at {args.stop_at} must be between 0 and --steps {args.steps}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    names = recipes(args.recipes)
    sigkill = [r for r in args.sigkill.split(",") if r]
    unknown = sorted(set(sigkill) - set(names))
    if unknown:
        print(f"quality_proof.py: --sigkill {','.join(unknown)}: not among the recipes {names}", file=sys.stderr)
        return 2
    work = Path(args.work).resolve() / args.algo  # train_small.sh runs in the variant's dir: no relative paths
    base_env = run_env(args)
    base_env["TINY_ASSETS"] = str(build_assets(args, base_env))
    common = [
        f"algo={args.algo}",
        f"trainer.save_freq={args.save_freq}",
        f"trainer.test_freq={args.test_freq}",
        "trainer.val_before_train=true",
    ]
    plan = plan_variants(args, names, sigkill)

    bar = tqdm(total=len(plan), desc=f"quality proof ({args.algo})", unit="variant")
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {
            pool.submit(run_variant, variant, recipe, runs, common, work, base_env, args): variant
            for variant, recipe, runs in plan
        }
        for future in as_completed(futures):
            future.result()  # a failed run ends the proof with its log's tail
            bar.set_postfix_str(f"{futures[future]} done")
            bar.update()
    bar.close()

    docs = Path(args.docs).resolve()
    specs = [f"{variant}={work / variant}" for variant, _, _ in plan]
    marks = []
    if not args.no_resume:
        marks.append(f"{args.stop_at}=stopped after this step, resumed (the *_resume runs)")
    for r in sigkill:
        killed = (work / f"{r}_sigkill" / "train_killed.log").read_text(errors="replace")
        step = int(killed.rsplit(KILL_NOTE, 1)[1].split()[0])
        marks.append(
            f"{step}=SIGKILL of {r}_sigkill's whole process tree after this step, resumed from its last checkpoint"
        )
    cmd = [
        sys.executable,
        "-m",
        "scripts.compare.runs",
        *specs,
        *(f"--mark={m}" for m in marks),
        "--out",
        str(docs / f"compare_{args.algo}.png"),
        "--table",
        str(docs / f"compare_{args.algo}.md"),
        "--title",
        f"{args.algo} on the tiny model (CPU, 2 ranks, warm start: {args.warmup_steps} supervised steps): "
        "verl defaults vs slimckpt recipes",
    ]
    commit = source_commit()  # before the table is written: the code the runs above ran
    rc = subprocess.call(cmd, cwd=REPO)
    if rc == 0:
        add_provenance(docs / f"compare_{args.algo}.md", argv, commit)
    return rc


def add_provenance(table: Path, argv: list[str] | None, commit: str) -> None:
    """The table compare_runs.py wrote, headed by the command and commit that made it."""
    command = "python -m scripts.compare.quality_proof " + " ".join(sys.argv[1:] if argv is None else argv)
    head = (
        f"Written by `{command.strip()}` at commit {commit}, {time.strftime('%Y-%m-%d')}; how to read it: "
        f"[training_comparison.md](training_comparison.md).\n\n"
    )
    tmp = table.with_name(table.name + ".partial")
    tmp.write_text(head + table.read_text())
    os.replace(tmp, table)


if __name__ == "__main__":
    sys.exit(main())
