#!/usr/bin/env python
"""Environment faults x write paths: does each failure give one clear line, fail (nonzero exit or
an exception), and leave nothing that looks committed? verl's own paths are run next to ours.

    python -m scripts.faults.env                     # table on stdout (time: BENCHMARKS.md, Figures quoted in the code)
    python -m scripts.faults.env --json faults.json  # + the rows as JSON (scripts/faults/reliability.py)
    python -m scripts.faults.env --paths merge,verl_merge --faults lock

Faults (how each is made; the report says which mechanism ran):
  disk_full    a tmpfs mounted at a few hundred KiB (needs mount permission: root or CAP_SYS_ADMIN;
               skipped otherwise, fsize_limit still covers a full disk)
  fsize_limit  RLIMIT_FSIZE of 64 KiB around the write (SIGXFSZ ignored, so writes fail with EFBIG
               instead of killing the process: verl's path would otherwise just die)
  read_only    a read-only tmpfs (EROFS); without mount permission a chmod 555 directory (EACCES)
  permission   the checkpoint root / --target_dir's parent chmod 000; as root, the writer runs with
               CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER dropped (setpriv), so it bites
  lock         another process holds slimckpt's writer lock on the target (slimckpt.storage.locks): a second
               `slimckpt merge` into one --target_dir, a second trainer saving the same step
  export_full  (save paths with an in-training HF export) a tmpfs sized from a calibration save of the same
               path: the shards, extra state and configs fit, half the export's weights do not, so the
               disk fills while the export is written (needs mount permission, as disk_full)

Paths (a recipe's path takes the actor's checkpoint block of recipes/<recipe>.yaml as shipped, export
on where the recipe has it, and overrides only what its name says):
  merge              `slimckpt merge` (CLI, exit status)
  verl_merge         `python -m verl.model_merger merge --backend fsdp` with SLIMCKPT_DISABLE=1
  verl_save          verl's FSDPCheckpointManager.save_checkpoint, no recipe (verl's default)
  quickstart         +recipe=quickstart's config through verl's real manager (world size 1, gloo)
  intermediate       +recipe=intermediate: verl's save + the in-training HF export (hf_export)
  incremental_sync   +recipe=incremental: DCP save + the gather-free HF export (hf_direct_export)
  incremental_async  +recipe=incremental with async_save (the failure surfaces at the commit wait)
  quickstart_continue  quickstart with on_save_error=continue: the save returns, training goes on

"looks committed": merge paths: `<target>` exists (slimckpt commits by renaming `<target>.partial`;
verl writes into `<target>` directly). Save paths: the incremental tier's manifest exists, or (verl's
format) fsdp_config.json and the rank's model file exist with no slimckpt failure marker. A save
that returns is followed by the trainer's tracker write, as verl's trainer does; "tracker moved"
says whether latest_checkpointed_iteration.txt then names the failed step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from scripts.faults.env_places import FSIZE_LIMIT, FULL_SIZE, Env
from scripts.faults.env_report import MERGE_PATHS, SAVE_PATHS, render, verdict

# lazy imports: a child sets its rank environment and resource limits before torch and slimckpt load
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = ["disk_full", "fsize_limit", "read_only", "permission", "lock", "export_full"]
PATHS = MERGE_PATHS + SAVE_PATHS
EXPORT_PATHS = ("intermediate", "incremental_sync", "incremental_async")  # the recipes that export while training
PAGE = 4096
STEP = 7
DROP_CAPS = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]


def target_of(path: str, base: str) -> str:
    """The directory a path writes: merge output, or the role dir of step STEP."""
    if path in MERGE_PATHS:
        return os.path.join(base, "merged")
    return os.path.join(base, "ckpt", f"global_step_{STEP}", "actor")


# --------------------------------------------------------------------------- verdicts


def first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):  # the last error line of a traceback, or the CLI's one line
        if "error" in ln.lower() or "Error" in ln or "denied" in ln.lower() or "space" in ln.lower():
            return ln[:400]
    return (lines[-1] if lines else "")[:400]


def looks_committed(path: str, target: str) -> bool:
    if path in MERGE_PATHS:
        return os.path.isdir(target) and bool(os.listdir(target))
    try:
        names = set(os.listdir(target))
    except OSError:
        return False
    if "slimckpt_resume.json" in names:
        return True
    failed = any(n.startswith("slimckpt_save_failed_rank_") for n in names)
    return "fsdp_config.json" in names and "model_world_size_1_rank_0.pt" in names and not failed


def tracker_moved(target: str) -> bool:
    root = os.path.dirname(os.path.dirname(target))
    try:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
            return f.read().strip() == str(STEP)
    except OSError:
        return False


# --------------------------------------------------------------------------- the merge paths (CLI)


def make_source(work: str) -> str:
    """A small verl FSDP checkpoint (one rank), big enough to fill the tmpfs when merged."""
    from pathlib import Path

    from slimckpt_testing.synthetic import synthetic_checkpoint, tiny_llama_config
    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import build_tokenizer

    cfg = tiny_llama_config(vocab_size=512, hidden_size=128, intermediate_size=256)
    actor = synthetic_checkpoint(Path(work) / "source" / "global_step_1" / "actor", 1, cfg)
    build_tokenizer(512).save_pretrained(actor / "huggingface")  # verl's merger needs one
    return str(actor)


def _preexec(fault: str):
    def fn() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if fault == "fsize_limit":
            resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return fn


def run_merge(env: Env, path: str, fault: str, source: str, base: str) -> dict:
    target = target_of(path, base)
    if path == "merge":
        cmd = [
            sys.executable,
            "-m",
            "slimckpt.cli",
            "merge",
            "--local_dir",
            source,
            "--target_dir",
            target,
            "--no_progress",
        ]
        extra_env = {}
    else:
        cmd = [
            sys.executable,
            "-m",
            "verl.model_merger",
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            source,
            "--target_dir",
            target,
        ]
        extra_env = {"SLIMCKPT_DISABLE": "1"}
    if env.drop_caps:
        cmd = DROP_CAPS + cmd
    holder = None
    if fault == "lock":
        from slimckpt.storage import locks

        holder = locks.acquire(target, exclusive=True, what="merging (env_faults' stand-in for a first merge)", fix="")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
            preexec_fn=_preexec(fault),
            env={**os.environ, "OMP_NUM_THREADS": "1", **extra_env},
        )
    finally:
        if holder is not None:
            holder.release()
    out = proc.stderr + proc.stdout
    ok = proc.returncode == 0
    return {
        "exit": proc.returncode,
        "failed": not ok,
        "message": "" if ok else first_line(proc.stderr or out),
        "traceback": "Traceback (most recent call last)" in out,
        "looks_committed": looks_committed(path, target),
        "tracker_moved": None,
        "seconds": round(time.perf_counter() - t0, 2),
    }


# --------------------------------------------------------------------------- the save paths (child)


def _config(path: str):
    """The actor's checkpoint config of `path`: verl's default, or its recipe's block as shipped."""
    from verl.trainer.config.config import CheckpointConfig

    from slimckpt.verl.recipes import recipe_checkpoint_config

    if path == "verl_save":
        return CheckpointConfig(save_contents=["model", "optimizer", "extra"])
    if path in ("quickstart", "quickstart_continue"):
        return recipe_checkpoint_config("quickstart", on_save_error="continue" if path.endswith("continue") else "stop")
    if path == "intermediate":
        return recipe_checkpoint_config("intermediate")
    # the recipe's 16 GiB staging budget is the machine's to check, not the fault's: 1 GiB here
    return recipe_checkpoint_config("incremental", async_save=path == "incremental_async", host_memory_budget_gb=1.0)


def _pages(path: str) -> int:
    return -(-os.path.getsize(path) // PAGE) * PAGE  # tmpfs holds whole pages


def export_full_size(base: str) -> int:
    """A tmpfs size that holds a save like the one under `base` except half its export's weights."""
    rest, weights = 0, 0
    for dirpath, _dirs, files in os.walk(base):
        for name in files:
            size = _pages(os.path.join(dirpath, name))
            if name.endswith(".safetensors"):
                weights += size
            else:
                rest += size
    if not weights:
        raise RuntimeError(f"{base}: the calibration save wrote no HF export")
    return rest + weights // 2


def calibrate(args: argparse.Namespace) -> int:
    """One save of `args.path` into an ordinary directory: the size export_full mounts."""
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    )
    import torch.distributed as dist

    import slimckpt.save.modes.writer as resume_async
    from slimckpt.verl.features import switch_on
    from slimckpt.verl.manager_state import state_of
    from slimckpt_testing.scenarios.tiny_run import Run

    switch_on("checkpoint")
    dist.init_process_group("gloo")
    run = Run(0, _config(args.path))
    run.step()
    run.manager.save_checkpoint(target_of(args.path, args.base), global_step=STEP, max_ckpt_to_keep=1)
    resume_async.writer_for(state_of(run.manager)).wait()
    with open(args.out, "w") as f:
        json.dump({"size": export_full_size(args.base)}, f)
    dist.destroy_process_group()
    return 0


def write_tracker_as_trainer(root: str, path: str) -> None:
    """What verl's trainer does once the workers' saves return (and slimckpt's patch of it, which
    puts the tracker back when a save left a failure marker)."""
    from slimckpt.layout.resume_manifest import read_tracker
    from slimckpt.save.errors import restore_tracker

    previous = read_tracker(root)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(STEP))
    if path != "verl_save":
        restore_tracker(root, STEP, previous)


def child(args: argparse.Namespace) -> int:
    """One save path, every fault in turn, in one process (world size 1, gloo)."""
    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    )
    import torch.distributed as dist

    import slimckpt.save.modes.writer as resume_async
    from slimckpt.verl.features import switch_on
    from slimckpt.verl.manager_state import state_of
    from slimckpt_testing.scenarios.tiny_run import Run

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    switch_on("checkpoint")  # as a recipe's config does; verl_save's plain config bypasses it
    dist.init_process_group("gloo")
    run = Run(0, _config(args.path))
    run.step()
    rows = []
    for fault, base in zip(args.faults.split(","), args.bases.split(",")):
        target = target_of(args.path, base)
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        t0 = time.perf_counter()
        error = None
        try:
            if fault == "fsize_limit":
                resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, hard))
            try:
                run.manager.save_checkpoint(target, global_step=STEP, max_ckpt_to_keep=1)
                if args.path == "incremental_async":
                    # a background write's failure surfaces where the trainer next waits on it: the
                    # next save (the tracker watcher sees the failure marker too)
                    run.manager.save_checkpoint(
                        target.replace(f"global_step_{STEP}", f"global_step_{STEP + 1}"),
                        global_step=STEP + 1,
                        max_ckpt_to_keep=1,
                    )
                resume_async.writer_for(state_of(run.manager)).wait()
                try:
                    write_tracker_as_trainer(os.path.dirname(os.path.dirname(target)), args.path)
                except OSError as exc:  # verl's trainer cannot write its tracker there either: it stops
                    raise RuntimeError(f"(the save continued; verl trainer's tracker write) {exc}") from None
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        except BaseException as exc:  # noqa: BLE001 - the verdict records it (DCP raises BaseExceptions)
            if isinstance(exc, KeyboardInterrupt):
                raise
            error = exc
        from slimckpt.verl.manager_state import state_of

        continued = error is None and bool(state_of(run.manager).save_failed)
        message = (
            (str(error).strip().splitlines() or [""])[0]
            if error is not None
            else (state_of(run.manager).save_failed or "")
        )
        if error is not None and not str(error).strip():
            message = type(error).__name__
        if error is not None and type(error).__name__ not in message:
            message = f"{type(error).__name__}: {message}"
        rows.append(
            {
                "fault": fault,
                "exit": "raised" if error is not None else ("continued" if continued else 0),
                "failed": error is not None or continued,
                "message": message[:1000],
                "looks_committed": looks_committed(args.path, target),
                "tracker_moved": tracker_moved(target),
                "seconds": round(time.perf_counter() - t0, 2),
            }
        )
    with open(args.out, "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()
    return 0


def calibration_size(env: Env, path: str, port: int) -> int:
    """export_full's tmpfs size for `path` (a calibration save in a child, on the work dir's filesystem)."""
    base = os.path.join(env.work, "calibration", path)
    out = base + ".json"
    cmd = [
        sys.executable,
        "-m",
        "scripts.faults.env",
        "_calibrate",
        "--path",
        path,
        "--base",
        base,
        "--out",
        out,
        "--port",
        str(port),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "SLIMCKPT_LOG_LEVEL": "WARNING"},
    )
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"calibration save of {path} failed (exit {proc.returncode}): {first_line(proc.stderr)}")
    with open(out) as f:
        return int(json.load(f)["size"])


def run_saves(env: Env, path: str, faults: list[str], bases: list[str], port: int) -> list[dict]:
    holders = []
    from slimckpt.storage import locks

    for fault, base in zip(faults, bases):
        if fault == "lock":
            target = target_of(path, base)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            holders.append(
                locks.acquire(target, exclusive=True, what="saving step 7 (env_faults' other trainer)", fix="")
            )
    out = os.path.join(env.work, f"{path}.rows.json")
    cmd = [
        sys.executable,
        "-m",
        "scripts.faults.env",
        "_child",
        "--path",
        path,
        "--faults",
        ",".join(faults),
        "--bases",
        ",".join(bases),
        "--out",
        out,
        "--port",
        str(port),
    ]
    if env.drop_caps:
        cmd = DROP_CAPS + cmd
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1", "SLIMCKPT_LOG_LEVEL": "WARNING"},
        )
    finally:
        for h in holders:
            h.release()
    if proc.returncode != 0 or not os.path.exists(out):
        sys.stderr.write(f"--- env_faults child for {path} failed (exit {proc.returncode}):\n{proc.stderr[-12000:]}\n")
        return [
            {
                "fault": f,
                "exit": proc.returncode,
                "failed": True,
                "looks_committed": None,
                "tracker_moved": None,
                "message": f"env_faults child crashed: {first_line(proc.stderr)}",
                "seconds": None,
            }
            for f in faults
        ]
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="OUT", help="also write {'env': ..., 'rows': [...]} here")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {','.join(PATHS)}")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated subset of {','.join(FAULTS)}")
    p.add_argument("--jobs", type=int, default=2, help="paths run at once (default 2)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (its path is printed)")
    sub = p.add_subparsers(dest="cmd")
    c = sub.add_parser("_child", help=argparse.SUPPRESS)
    for a in ("--path", "--faults", "--bases", "--out"):
        c.add_argument(a, required=True)
    c.add_argument("--port", type=int, required=True)
    c = sub.add_parser("_calibrate", help=argparse.SUPPRESS)
    for a in ("--path", "--base", "--out"):
        c.add_argument(a, required=True)
    c.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    if args.cmd == "_child":
        return child(args)
    if args.cmd == "_calibrate":
        return calibrate(args)

    paths = [x for x in args.paths.split(",") if x]
    faults = [x for x in args.faults.split(",") if x]
    unknown = sorted(set(paths) - set(PATHS)) + sorted(set(faults) - set(FAULTS))
    if unknown:
        p.error(f"unknown path or fault {unknown}; paths: {PATHS}; faults: {FAULTS}")
    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="slimckpt_env_faults_")
    env = Env(work)
    rows: list[dict] = []
    try:
        source = make_source(work) if any(x in MERGE_PATHS for x in paths) else ""
        calibrated = [x for x in paths if x in EXPORT_PATHS] if "export_full" in faults and env.can_mount else []
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            sizes = dict(
                zip(
                    calibrated,
                    pool.map(
                        lambda x, port: calibration_size(env, x, port),
                        calibrated,
                        [29900 + 17 * i + os.getpid() % 500 for i in range(len(calibrated))],
                    ),
                )
            )
        plan: list[tuple[str, list[str], list[str]]] = []
        for path in paths:
            runnable, bases = [], []
            for fault in faults:
                if fault == "export_full" and path not in EXPORT_PATHS:
                    continue  # nothing is exported while training there
                if env.mechanism(fault) is None:
                    rows.append(
                        {
                            "path": path,
                            "fault": fault,
                            "skipped": True,
                            "failed": None,
                            "message": "cannot be made here (see mechanism notes)",
                        }
                    )
                    continue
                runnable.append(fault)
                bases.append(env.base(path, fault, sizes.get(path)))
            plan.append((path, runnable, bases))

        # one item per save path (one process, every fault) and per merge run (one CLI each)
        items = [(p_, fs, bs) for p_, fs, bs in plan if p_ not in MERGE_PATHS]
        items += [(p_, [f], [b]) for p_, fs, bs in plan if p_ in MERGE_PATHS for f, b in zip(fs, bs)]

        def one(item, port):
            path, fs, bs = item
            if path in MERGE_PATHS:
                return [dict(run_merge(env, path, f, source, b), fault=f) for f, b in zip(fs, bs)]
            return run_saves(env, path, fs, bs, port)

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(one, items, [29500 + 17 * i + os.getpid() % 500 for i in range(len(items))]))
        for (path, _fs, bs), res in zip(items, results):
            for r, base in zip(res, bs):
                r["path"] = path
                r["mechanism"] = env.mechanism(r["fault"])
                if r["fault"] == "export_full":
                    r["mechanism"] += f" ({sizes[path] // 1024} KiB)"
                msg = r.get("message") or ""
                r["one_line"] = bool(msg) and not r.get("traceback")
                r["names_path"] = base in msg or os.path.basename(base) in msg and "/" in msg
                r["message"] = msg.replace(work, "$WORK")  # the report shows the fix, not the temp dir
                rows.append(r)
    finally:
        env.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work dir kept: {work}")
    order = {(p_, f_): i for i, (p_, f_) in enumerate((p_, f_) for p_ in PATHS for f_ in FAULTS)}
    rows.sort(key=lambda r: order[(r["path"], r["fault"])])
    for r in rows:
        r["verdict"] = verdict(r)
    print(render(rows))
    seconds = time.perf_counter() - t0
    print(
        f"\n{len(rows)} cases in {seconds:.0f} s; mount: {'yes' if env.can_mount else 'no'}, root: {env.root}, "
        f"capabilities dropped for the writers: {env.drop_caps}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "env": {
                        "can_mount": env.can_mount,
                        "root": env.root,
                        "drop_caps": env.drop_caps,
                        "fsize_limit_bytes": FSIZE_LIMIT,
                        "tmpfs_sizes": FULL_SIZE,
                        "seconds": round(seconds, 1),
                    },
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
