"""Corruption campaign for `slimckpt verify` and the incremental tier's load check.

    python -m scripts.faults.corruption [--trials 120] [--native_trials 60] [--seed 0] [--json OUT]

Builds three small real checkpoints once (CPU, gloo, the tiny Llama of
slimckpt_testing.verl_checkpoints.fsdp_checkpoint, 2 ranks, one torchrun of this script with --_save):
  - incremental: a save through verl's FSDPCheckpointManager with recipes/incremental.yaml's actor
    block as shipped (DCP shards, per-rank extra state, huggingface/ with its HF export,
    slimckpt_resume.json), tracker and data.pt;
  - verl-native: the same model saved by verl's own code (the manager with a plain config);
  - merge output: slimckpt's merge of that checkpoint, split into several safetensors files.
Then each trial copies one, damages it in one way and asks `slimckpt verify` (verify_path, the
CLI's code) whether it is bad and which file it names. Kinds: truncation, a single bit flip at a
random offset (also aimed at safetensors headers and .distcp bodies), a deleted file, two rank
files swapped, a stray file, a damaged manifest (truncated, bit-flipped, deleted). For the
incremental checkpoint the load check (resume_manifest.check_committed, what
load_resume_state runs) must refuse with the very line verify printed; at the end one torchrun
loads every damaged incremental copy through verl's FSDPCheckpointManager (--_load) and records
what it raised.

The slimckpt formats (merge, incremental) are counted for the 100% claim; verl-native trials are
reported apart: verl writes no checksums, so what is caught there is what torch's zip CRC32,
file names, loads and shapes reveal.

    python -m scripts.faults.corruption --damaged_restarts 30 [--seed 0] [--json OUT]

instead runs N restarts whose newest committed step is damaged (patches/slimckpt_testing/scenarios/driver.py
damaged_newest, one torchrun of 2 ranks: steps 2 and 4 saved async with the export through verl's
manager, then per restart a copy with step 4 damaged one way - a flipped .distcp byte, a truncated
or deleted file, a damaged or unsealed manifest - and a fresh model resumed through verl's
PPOTrainer._load_checkpoint with resume_mode=auto). A restart is exact when it goes on from step 2
with the state, RNG and next loss of a plain load of step 2, one line names the damaged file, the
tracker names 2, step 4 is still on disk, and resume_from_path to step 4 refuses in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

from scripts.faults.corruption_damage import damage
from scripts.faults.corruption_report import render
from scripts.provenance import source_commit

# lazy imports: torch, verl and slimckpt load in the torchrun children and in the phase that needs them

KINDS = ("truncate", "bitflip", "bitflip_header", "delete", "swap", "extra", "manifest")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLIM_FORMATS = ("merge", "incremental")
ROLE = "actor"
STEP = 1


# --------------------------------------------------------------------------- source checkpoints


def _run(cmd: list[str], timeout: int = 300) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLIMCKPT_LOG_LEVEL": "WARNING"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(
            f"corruption_campaign: {' '.join(cmd[:6])} ... failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )


def _torchrun(nproc: int, *args: str, timeout: int = 300) -> None:
    _run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args], timeout
    )


def build_sources(work: str) -> dict[str, str]:
    """{format: dir to copy per trial}, built once: one torchrun saves the verl-native and the
    incremental checkpoint, then the native one is merged here."""
    from slimckpt.merge.pipeline import merge
    from slimckpt.merge.plan import MergeOptions

    _torchrun(2, "-m", "scripts.faults.corruption", "--_save", work)
    native = os.path.join(work, "native", f"global_step_{STEP}", ROLE)
    merged = os.path.join(work, "merged")
    merge(MergeOptions(local_dir=native, target_dir=merged, max_shard_size="80KB", progress=False))
    return {
        "native": native,
        "merge": merged,
        "incremental": os.path.join(work, "incremental", f"global_step_{STEP}", ROLE),
    }


def _tiny_run(ckpt_config):
    """Model, optimizer, scheduler and verl's manager of the tiny fixture model on this group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    import slimckpt_testing.verl_checkpoints.fsdp_checkpoint as fx

    args = fx.parse_args(["--out", "unused"])
    torch.manual_seed(0)
    world = dist.get_world_size()
    model = AutoModelForCausalLM.from_config(fx.build_config(args), dtype=torch.float32)
    model = fx.wrap_fsdp2(model, init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)), "dim0", world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    fx.train_steps(model, optimizer, args.vocab, 1, 0)
    return FSDPCheckpointManager(
        model, optimizer, scheduler, processing_class=fx.build_tokenizer(args.vocab), checkpoint_config=ckpt_config
    )


def _slim_config():
    """+recipe=incremental's actor block as shipped (its HF export on: the export's files are damaged too)."""
    from slimckpt.verl.recipes import recipe_checkpoint_config

    return recipe_checkpoint_config("incremental")


def worker_save(work: str) -> None:
    """(under torchrun) the same trained model saved twice through verl's manager: verl's own
    format (work/native) and the incremental tier (work/incremental, with the tracker and data.pt)."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from slimckpt.engine.resume_records import write_tracker
    from slimckpt.save.resume_state import finish_pending

    dist.init_process_group("gloo")
    manager = _tiny_run(_slim_config())
    root = os.path.join(work, "incremental")
    manager.save_checkpoint(os.path.join(root, f"global_step_{STEP}", ROLE), global_step=STEP)
    finish_pending()
    if dist.get_rank() == 0:
        torch.save({"step": STEP}, os.path.join(root, f"global_step_{STEP}", "data.pt"))
        write_tracker(root, STEP)
    manager.checkpoint_config = OmegaConf.create(
        {"save_contents": ["model", "optimizer", "extra"], "load_contents": ["model", "optimizer", "extra"]}
    )
    manager.checkpoint_save_contents = ["model", "optimizer", "extra"]
    manager.save_checkpoint(os.path.join(work, "native", f"global_step_{STEP}", ROLE), global_step=STEP)
    dist.barrier()
    dist.destroy_process_group()


def worker_cost(preset: str, root: str) -> None:
    """(under torchrun) what checksums cost: one incremental save of `preset` through verl's
    manager (the manifest's timings: write vs checksum), then one load (its check vs the whole load)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    import slimckpt_testing.verl_checkpoints.fsdp_checkpoint as fx
    from slimckpt.layout.resume_manifest import read_manifest
    from slimckpt.resume import step_check
    from slimckpt.save import resume_state

    dist.init_process_group("gloo")
    args = fx.parse_args(["--out", "unused", "--size-preset", preset])
    torch.manual_seed(0)
    world = dist.get_world_size()
    model = AutoModelForCausalLM.from_config(fx.build_config(args), dtype=torch.float32)
    model = fx.wrap_fsdp2(model, init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)), "dim0", world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fx.train_steps(model, optimizer, args.vocab, 1, 0)
    manager = FSDPCheckpointManager(
        model, optimizer, None, processing_class=fx.build_tokenizer(args.vocab), checkpoint_config=_slim_config()
    )
    path = os.path.join(root, "global_step_1", ROLE)
    t0 = time.perf_counter()
    manager.save_checkpoint(path, global_step=1)
    resume_state.finish_pending()
    save_s = time.perf_counter() - t0
    dist.barrier()
    real_check = step_check.check_committed
    check_s: list[float] = []

    def timed_check(*a, **k):
        t = time.perf_counter()
        try:
            return real_check(*a, **k)
        finally:
            check_s.append(time.perf_counter() - t)

    step_check.check_committed = timed_check
    step = {}
    if dist.get_rank() == 0:  # resume_mode=auto's check of the step, in one process as verl's driver runs it
        from slimckpt.resume.intact_resume import check_step

        torch.save({"step": 1}, os.path.join(root, "global_step_1", "data.pt"))
        for checksums in (False, True):
            check = check_step(root, 1, {ROLE: checksums})
            assert check.damage is None, check.damage
            step["auto_check_s" if checksums else "auto_sizes_s"] = round(check.seconds, 3)
    dist.barrier()
    t0 = time.perf_counter()
    manager.load_checkpoint(path)
    load_s = time.perf_counter() - t0
    if dist.get_rank() == 0:
        m = read_manifest(path)
        out = {
            "preset": preset,
            "world_size": world,
            "bytes": sum(f.size for f in m.files),
            "save_s": round(save_s, 2),
            "timings_s": m.extra.get("timings_s"),
            "load_s": round(load_s, 2),
            "load_check_s": round(check_s[0], 2),
            **step,
        }
        with open(os.path.join(root, "cost.json"), "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def checksum_cost(preset: str, workdir: str | None) -> dict:
    work = tempfile.mkdtemp(prefix="slimckpt-checksum-cost-", dir=workdir)
    try:
        _torchrun(2, "-m", "scripts.faults.corruption", "--_cost", preset, work, timeout=900)
        with open(os.path.join(work, "cost.json")) as f:
            return json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def worker_load(listing: str) -> None:
    """(under torchrun) load every dir named in `listing` through verl's manager; rank 0 writes
    {dir: what the load raised} next to it."""
    import torch.distributed as dist

    from slimckpt.layout.resume_manifest import UncommittedCheckpoint

    dist.init_process_group("gloo")
    manager = _tiny_run(_slim_config())
    with open(listing) as f:
        dirs = json.load(f)
    out = {}
    for d in dirs:
        try:
            manager.load_checkpoint(d)
            out[d] = {"refused": False, "message": ""}
        except UncommittedCheckpoint as exc:
            out[d] = {"refused": True, "message": str(exc)}
    if dist.get_rank() == 0:
        with open(listing + ".result.json", "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- one trial


def run_trial(source: str, work: str, fmt: str, kind: str, rng: random.Random, i: int, keep: bool) -> dict:
    import slimckpt.layout.resume_manifest as rm
    from slimckpt.verify.command import NotACheckpoint, verify_path

    copy = os.path.join(work, "trials", f"{i:04d}_{fmt}_{kind}", ROLE if fmt != "merge" else "merged")
    shutil.copytree(source, copy)
    trial = damage(copy, fmt, kind, rng)
    try:
        report = verify_path(copy)
        lines = [p.message for p in report.bad]
        named = sorted({os.path.relpath(p.file, copy) for p in report.bad})
        flagged = not report.ok
    except NotACheckpoint as exc:  # nothing left that looks like a checkpoint: verify exits 2
        lines, named, flagged = [str(exc)], [], True
    result = {
        "i": i,
        "format": fmt,
        "kind": kind,
        "damage": trial.what,
        "detected": flagged,
        "named_right_file": any(t in named for t in trial.targets),
        "named": named[:4],
        "lines": lines[:4],
    }
    if fmt == "incremental":
        try:
            rm.check_committed(copy)
            load = None
        except rm.UncommittedCheckpoint as exc:
            load = str(exc)
        result["load_refused"] = load is not None
        result["load_message"] = load
        result["load_same_message"] = load is not None and load in lines
        result["dir"] = copy
    if not keep:
        shutil.rmtree(os.path.dirname(copy))
    return result


def summarise(trials: list[dict]) -> dict:
    out: dict = {}
    for t in trials:
        s = out.setdefault(t["format"], {}).setdefault(t["kind"], {"trials": 0, "detected": 0, "named_right_file": 0})
        s["trials"] += 1
        s["detected"] += int(t["detected"])
        s["named_right_file"] += int(t["named_right_file"])
        if "load_refused" in t:
            s["load_refused"] = s.get("load_refused", 0) + int(t["load_refused"])
            s["load_same_message"] = s.get("load_same_message", 0) + int(t["load_same_message"])
        if "real_load_refused" in t:
            s["real_load_refused"] = s.get("real_load_refused", 0) + int(t["real_load_refused"])
            s["real_load_same_message"] = s.get("real_load_same_message", 0) + int(t["real_load_same_message"])
    return out


def campaign(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="slimckpt-corruption-", dir=args.workdir)
    t0 = time.perf_counter()
    try:
        sources = build_sources(work)
        build_s = time.perf_counter() - t0
        from slimckpt.verify.command import verify_path

        # a false alarm on an undamaged checkpoint would make every detection below meaningless
        clean = {fmt: verify_path(path) for fmt, path in sources.items()}
        false_alarms = {fmt: [p.message for p in r.bad] for fmt, r in clean.items() if not r.ok}
        if false_alarms:
            raise SystemExit(f"corruption_campaign: verify flags an undamaged checkpoint: {false_alarms}")
        slim, native = [], []
        plan = [(SLIM_FORMATS[i % 2], KINDS[(i // 2) % len(KINDS)]) for i in range(args.trials)]
        plan += [("native", KINDS[i % len(KINDS)]) for i in range(args.native_trials)]
        from tqdm import tqdm

        for i, (fmt, kind) in enumerate(tqdm(plan, desc="trials", disable=not sys.stderr.isatty())):
            r = run_trial(sources[fmt], work, fmt, kind, rng, i, keep=fmt == "incremental")
            (native if fmt == "native" else slim).append(r)
        real = [t for t in slim if t["format"] == "incremental"]
        if real and not args.no_real_load:
            listing = os.path.join(work, "load_dirs.json")
            with open(listing, "w") as f:
                json.dump([t["dir"] for t in real], f)
            _torchrun(2, "-m", "scripts.faults.corruption", "--_load", listing, timeout=600)
            with open(listing + ".result.json") as f:
                loaded = json.load(f)
            for t in real:
                got = loaded[t["dir"]]
                t["real_load_refused"] = got["refused"]
                t["real_load_same_message"] = got["refused"] and got["message"] in t["lines"]
        for t in slim:
            t.pop("dir", None)
        total = len(slim)
        detected = sum(t["detected"] for t in slim)
        named = sum(t["named_right_file"] for t in slim)
        return {
            "seed": args.seed,
            "clean_sources_ok": sorted(clean),
            "seconds": round(time.perf_counter() - t0, 1),
            "build_seconds": round(build_s, 1),
            "slimckpt": {
                "trials": total,
                "detected": detected,
                "named_right_file": named,
                "detection_rate": detected / total if total else None,
                "load_trials": len(real),
                "load_refused_same_message": sum(t.get("load_same_message", False) for t in real),
                "real_load_run": bool(real) and not args.no_real_load,
                "real_load_refused_same_message": sum(t.get("real_load_same_message", False) for t in real),
                "by_format_kind": summarise(slim),
            },
            "native": {
                "trials": len(native),
                "detected": sum(t["detected"] for t in native),
                "named_right_file": sum(t["named_right_file"] for t in native),
                "by_kind": summarise(native).get("native", {}),
                "note": "verl writes no checksums: bytes outside torch's zip CRC32 records (padding, "
                "timestamps), values in huggingface/ JSON that still parse and stray files of "
                "unknown names cannot be caught; not counted in the slimckpt rate",
            },
            "missed": [t for t in slim + native if not t["detected"]][:40],
            "slim_misnamed": [t for t in slim if t["detected"] and not t["named_right_file"]][:20],
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _restart_outcome(t: dict) -> str:
    """exact, or the first way a damaged-newest-step restart went wrong."""
    if t["error"]:
        return "crashed"
    if t["global_steps"] != 2 or t["data"] != {"step": 2} or t["diffs"] or not t["loss_equal"]:
        return "wrong state"
    if len(t["lines"]) != 1 or "\n" in t["lines"][0] or "global_step_4/actor" not in t["lines"][0]:
        return "not one line naming the file"
    if t["tracker"] != 2 or not t["step4_kept"]:
        return "tracker or files changed"
    if not t["refused"] or "\n" in t["refused"]:
        return "resume_from_path not refused in one line"
    return "exact"


def damaged_restarts(trials: int, seed: int, workdir: str | None) -> dict:
    from collections import Counter

    work = tempfile.mkdtemp(prefix="slimckpt-damaged-restarts-", dir=workdir)
    t0 = time.perf_counter()
    try:
        _torchrun(
            2,
            "-m",
            "slimckpt_testing.launch",
            "slimckpt_testing.scenarios.driver",
            "damaged_newest",
            "--dir",
            work,
            "--trials",
            str(trials),
            "--seed",
            str(seed),
            timeout=600 + 20 * trials,
        )
        with open(os.path.join(work, "damaged_newest_result.json")) as f:
            got = json.load(f)["trials"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for t in got:
        t["outcome"] = _restart_outcome(t)
    by_kind: dict = {}
    for t in got:
        by_kind.setdefault(t["kind"], Counter())[t["outcome"]] += 1
    return {
        "restarts": len(got),
        "seed": seed,
        "seconds": round(time.perf_counter() - t0, 1),
        "outcomes": dict(Counter(t["outcome"] for t in got)),
        "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "tracker_after_saving_3": got[0].get("tracker_after_saving_3") if got else None,
        "not_exact": [
            {k: t[k] for k in ("kind", "damage", "outcome", "error", "lines")} for t in got if t["outcome"] != "exact"
        ][:20],
        "example_line": got[0]["lines"][0] if got and got[0]["lines"] else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Inject corruptions into small real checkpoints and check that "
        "`slimckpt verify` (and the incremental load) catch every one."
    )
    p.add_argument("--trials", type=int, default=120, help="trials on slimckpt formats (merge, incremental)")
    p.add_argument("--native_trials", type=int, default=56, help="trials on a verl-native checkpoint (reported apart)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None, help="write the results here as JSON")
    p.add_argument("--workdir", default=None, help="where to build (default: the system temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and damaged copies")
    p.add_argument(
        "--no_real_load",
        action="store_true",
        help="skip the torchrun that loads every damaged incremental copy through verl's manager",
    )
    p.add_argument(
        "--checksum_cost",
        default=None,
        metavar="PRESET",
        help="instead of the campaign: time one incremental save and load of this fixture preset "
        "(e.g. 0.25b), checksumming vs the rest (prints JSON)",
    )
    p.add_argument(
        "--damaged_restarts",
        type=int,
        default=0,
        metavar="N",
        help="instead of the campaign: N resume_mode=auto restarts whose newest step is damaged "
        "(all must go on from the previous intact step exactly)",
    )
    p.add_argument("--_save", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_cost", nargs=2, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_load", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._save:
        worker_save(args._save)
        return 0
    if args._load:
        worker_load(args._load)
        return 0
    if args._cost:
        worker_cost(*args._cost)
        return 0
    if args.checksum_cost:
        cost = checksum_cost(args.checksum_cost, args.workdir)
        print(json.dumps(cost, indent=1))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(cost, f, indent=1)
        return 0
    if args.damaged_restarts:
        commit = source_commit()  # before the run: what the trials imported
        restarts = damaged_restarts(args.damaged_restarts, args.seed, args.workdir)
        restarts["commit"] = commit
        print(json.dumps(restarts, indent=1))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(restarts, f, indent=1)
        return 0 if restarts["outcomes"] == {"exact": restarts["restarts"]} else 1
    result = campaign(args)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    print(render(result))
    s = result["slimckpt"]
    ok = s["detected"] == s["trials"] and s["load_refused_same_message"] == s["load_trials"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
