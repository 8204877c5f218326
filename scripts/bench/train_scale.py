#!/usr/bin/env python
"""Save and resume inside verl at the largest model this host holds: a Llama-3.2-3B-shaped model
(3.61B parameters, embeddings untied: 14.4 GB in fp32), FSDP2, world size 2, gloo, verl 0.9.1's
real FSDPCheckpointManager, verl's own save and load against slimckpt's tiers, same run.

  make bench-train-scale                                   # -> BENCHMARKS.md, README, docs/bench_train_scale.json
  python -m scripts.bench.train_scale --preset 0.25b --resume-ref '' --out /tmp/t.md --json /tmp/t.json --readme ''
  python -m scripts.bench.train_scale --render docs/bench_train_scale.json    # re-render, no runs

The model takes 14.4 GB of host memory across the two ranks, and AdamW's two moments would take 28.9 GB
more, so no optimizer state is saved: every save is of the model and verl's extra state (lr scheduler,
RNG), `save_contents: [model, extra]` (intermediate: `[model]`, its recipe's own), and the optimizer is
SGD without momentum, which has no state. Each run is one fresh `torchrun` that builds the model (random
weights, each rank materialising only its own shards) and then, with its process tree killed (SIGKILL)
as soon as the tree's summed anonymous RSS passes --cap-gib, as the OOM killer would:

  verl          verl's own code (SLIMCKPT_DISABLE=1), save_contents [model, extra, hf_model]: the sharded
                files, then the whole fp32 model gathered on rank 0 for the Hugging Face export
  intermediate  `+recipe=intermediate`: verl's model shards plus the HF export streamed from them
  incremental   `+recipe=incremental` (sync): DCP resume state streamed, the gather-free HF export, verified
  stream        the same with async_save=stream, waited for (wall: until the step is committed)
  verl-resume   verl's own save of [model, extra] (the files verl resumes from), then verl's load of them
  incremental   (resume) after its save: the shards scrambled, the step loaded back by the tier's load,
                and every rank's shards compared byte for byte (a digest) with what was saved

Measured: each rank's peak RssAnon above its level just before the save (or load), sampled every 5 ms
by a process of its own (scripts.bench.save's sampler), wall until every rank is done, and the whole
tree's RssAnon every 0.25 s, which is what the picture draws and what the cap watches. The resume is
measured once more at --resume-ref (1b), where verl's load fits, so the two load walls can be compared.
The saves' directories are deleted after each run; the run needs --min-free-gib of free disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from scripts.bench.save import machine_line, mem_available, preset_params
from scripts.bench.save_report import write_section
from scripts.bench.scale import choose_cap, enough_disk, run_capped
from scripts.bench.train_scale_report import (
    RESUME_MODES,
    SAVE_MODES,
    GiB,
    load_words,
    outcome,
    render_section,
    write_readme,
)
from scripts.provenance import source_commit

# lazy imports: torch, verl and slimckpt load in the worker ranks only; the driver stays torch-free

REPO = Path(__file__).resolve().parents[2]
EVENT = re.compile(r"\[train-scale\] event (\S+) (\d+\.\d+)")
KERNEL_KILL = re.compile(r"exitcode\s*:\s*-9|Signals\.SIGKILL|signal 9", re.IGNORECASE)


# --------------------------------------------------------------------------- worker (one torchrun rank)


def checkpoint_config(mode: str):
    """The checkpoint block a mode saves with: verl's own, or the recipe's with the optimizer left out."""
    from omegaconf import OmegaConf

    if mode == "verl":
        return OmegaConf.create({"save_contents": ["model", "extra", "hf_model"], "load_contents": ["model", "extra"]})
    if mode == "verl-resume":
        return OmegaConf.create({"save_contents": ["model", "extra"], "load_contents": ["model", "extra"]})
    from slimckpt.verl.recipes import recipe_checkpoint_config

    if mode == "intermediate":
        return recipe_checkpoint_config("intermediate")
    return recipe_checkpoint_config(
        "incremental",
        save_contents=["model", "extra"],
        load_contents=["model", "extra"],
        async_save="stream" if mode == "stream" else False,
    )


def shard_digest(model) -> str:
    """blake2b over every parameter's local shard, bytes as they are (no copy of the shard)."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    for name, p in model.named_parameters():
        local = (p.to_local() if hasattr(p, "to_local") else p).detach()
        h.update(name.encode())
        if local.numel():
            h.update(local.contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def event(rank: int, name: str) -> None:
    if rank == 0:
        print(f"[train-scale] event {name} {time.time():.3f}", flush=True)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    from scripts.bench.rss_window import WindowSampler
    from scripts.bench.save import build_model, measured, name_pretrained, timed_save
    from slimckpt.observe.measure import evict_from_page_cache
    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import build_tokenizer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = WindowSampler()
    model, optimizer, scheduler, n_params, vocab = build_model(args.preset, world, adamw_state=False)
    name_pretrained(model, args.out)
    manager = FSDPCheckpointManager(
        model,
        optimizer,
        scheduler,
        processing_class=build_tokenizer(vocab),
        checkpoint_config=checkpoint_config(args.mode),
    )
    resume = args.mode in RESUME_MODES
    row = {"rank": rank, "world": world, "params": n_params, "saves": [], "load": None}

    def mark(name: str) -> None:
        event(rank, name)

    mark("built")
    for i in range(args.repeats):
        path = os.path.join(args.out, f"global_step_{i + 1}", "actor")
        save = timed_save(manager, sampler, path, i + 1, mark)
        files = [f for f in Path(path).rglob("*") if f.is_file()]
        row["saves"].append(
            {
                **save,
                "bytes_on_disk": sum(f.stat().st_size for f in files),
                "hf_safetensors": len(
                    [f for f in files if f.parent.name == "huggingface" and f.suffix == ".safetensors"]
                ),
            }
        )
        last = i == args.repeats - 1
        dist.barrier()
        if rank == 0 and not (last and resume):
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        dist.barrier()
    if resume:
        saved = shard_digest(model)
        with torch.no_grad():  # a load that does nothing must not pass
            for p in model.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).add_(1.0)
        os.sync()
        if rank == 0:  # both loads read from disk, not from the page cache the save left warm
            evict_from_page_cache([str(f) for f in Path(path).rglob("*") if f.is_file()])
        row["load"] = measured(sampler, lambda: manager.load_checkpoint(path) or {}, "load", "loaded", mark)
        row["load"]["equal"] = shard_digest(model) == saved
    sampler.close()
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(args.out, "result.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver


def run_one(preset: str, mode: str, args: argparse.Namespace, cap: int) -> dict:
    """One torchrun of `mode` at `preset`, under the cap: its rows, or how far it got when killed."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f"train-{preset}-{mode}-", dir=work))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "scripts.bench.train_scale",
        "--worker",
        "--mode",
        mode,
        "--preset",
        preset,
        "--repeats",
        str(args.repeats),
        "--out",
        str(out),
    ]
    env = {
        "OMP_NUM_THREADS": "1",
        "SLIMCKPT_LOG_LEVEL": "WARNING",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "patches"), os.environ.get("PYTHONPATH")])),
    }
    if mode.startswith("verl"):
        env["SLIMCKPT_DISABLE"] = "1"
    try:
        got = run_capped(cmd, env, cap, timeline_s=0.25, cwd=REPO)
        if not got["killed"] and got["returncode"] != 0 and KERNEL_KILL.search(got["output"]):
            # the kernel's OOM killer got there before the cap's watcher: a kill all the same
            got["killed"], got["killed_by"] = True, "the kernel's OOM killer"
            got["killed_at_s"] = (
                max(got["timeline"], key=lambda point: point[1])[0] if got["timeline"] else got["wall_s"]
            )
        result = out / "result.json"
        ranks = json.loads(result.read_text()) if result.exists() and not got["killed"] else None
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if ranks is None and not got["killed"]:
        log = work / f"train-{preset}-{mode}.log"
        log.write_text(got["output"])
        raise SystemExit(
            f"[bench-train-scale] {preset} {mode} failed (exit {got['returncode']}); log {log}:\n{got['output'][-3000:]}"
        )
    events = {name: float(t) - got["started_at"] for name, t in EVENT.findall(got["output"])}
    return summarise(preset, mode, got, events, ranks)


def recipe_export_dtype() -> str:
    recipe = yaml.safe_load((REPO / "recipes" / "incremental.yaml").read_text())
    return str(recipe["actor_rollout_ref"]["actor"]["checkpoint"].get("export_dtype", "bf16"))


def summarise(preset: str, mode: str, got: dict, events: dict[str, float], ranks: list[dict] | None) -> dict:
    row = {
        "preset": preset,
        "mode": mode,
        # the dtype of the incremental recipe's export in this run (the plan's check reads it)
        "export_dtype": recipe_export_dtype() if mode in ("incremental", "stream") else None,
        "killed": got["killed"],
        "killed_at_s": got["killed_at_s"],
        "tree_peak": got["peak_rss_anon"],
        "timeline": got["timeline"],
        "events": events,
    }
    if got["killed"]:
        row["killed_by"] = got.get("killed_by", "the cap")
        row["output_tail"] = got["output_tail"]
        # what it was doing when it was killed: the last event before the kill
        before = [(t, name) for name, t in events.items() if t <= got["killed_at_s"]]
        row["killed_in"] = max(before)[1] if before else "start-up"
        start = events.get(row["killed_in"])
        row["killed_after_s"] = got["killed_at_s"] - start if start is not None else None
        return row
    saves = list(zip(*(r["saves"] for r in ranks)))
    row.update(
        params=ranks[0]["params"],
        save_extra_per_rank=[max(s["peak"] for s in r["saves"]) - r["saves"][0]["level_before"] for r in ranks],
        first_save_extra_per_rank=[r["saves"][0]["peak"] - r["saves"][0]["level_before"] for r in ranks],
        walls=[max(s["wall_s"] for s in per_rank) for per_rank in saves],
        blockings=[max(s["blocking_s"] for s in per_rank) for per_rank in saves],
        bytes_on_disk=ranks[0]["saves"][0]["bytes_on_disk"],
        hf_safetensors=ranks[0]["saves"][0]["hf_safetensors"],
    )
    row["wall_s"], row["blocking_s"] = statistics.median(row["walls"]), statistics.median(row["blockings"])
    if ranks[0]["load"]:
        row["load"] = {
            "extra_per_rank": [r["load"]["peak"] - r["load"]["level_before"] for r in ranks],
            "wall_s": max(r["load"]["wall_s"] for r in ranks),
            "equal": all(r["load"]["equal"] for r in ranks),
        }
    return row


def shape(preset: str) -> str:
    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import PRESETS

    layers, hidden, inter, vocab, heads, kv = PRESETS[preset]
    return f"{layers} layers, hidden {hidden}, intermediate {inter}, vocabulary {vocab:,}, {heads} heads, {kv} KV heads"


def measure(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not enough_disk(work, args.min_free_gib, "bench-train-scale", "one step: the fp32 shards and their HF export"):
        return {}
    cap, cap_note = choose_cap(args.cap_gib)
    plan = [(args.preset, m) for m in args.modes] + [(args.preset, "verl-resume")]
    if args.resume_ref:
        plan += [(args.resume_ref, m) for m in RESUME_MODES]
    from tqdm import tqdm

    started, commit, rows = time.time(), source_commit(), []
    with tqdm(plan, desc="train-scale bench", unit="run") as bar:
        for preset, mode in bar:
            bar.set_postfix_str(f"{preset} {mode}")
            row = run_one(preset, mode, args, cap)
            rows.append(row)
            tqdm.write(
                f"[bench-train-scale] {preset} {mode}: {outcome(row)}"
                + (f"; load {load_words(row)}" if row.get("load") else "")
            )
    return {
        "rows": rows,
        "meta": {
            "command": args.command,
            "date": time.strftime("%Y-%m-%d"),
            "commit": commit,
            "seconds": time.time() - started,
            "machine": machine_line(),
            "available_gib": mem_available() / GiB,
            "cap": cap,
            "cap_note": cap_note,
            "preset": args.preset,
            "shape": shape(args.preset),
            "params": preset_params(args.preset),
            "resume_ref": args.resume_ref,
            "repeats": args.repeats,
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset", default="llama3.2-3b", help="the model (slimckpt_testing.verl_checkpoints.fsdp_checkpoint.PRESETS)"
    )
    p.add_argument(
        "--modes", default=",".join(SAVE_MODES), help="saves to run, comma-separated, from: " + ", ".join(SAVE_MODES)
    )
    p.add_argument(
        "--resume-ref",
        default="1b",
        help="a smaller preset whose resume is measured too, where verl's load fits; '' for none",
    )
    p.add_argument("--repeats", type=int, default=2, help="saves per run; the wall is their median")
    p.add_argument(
        "--cap-gib",
        type=float,
        default=18.0,
        help="a run's tree is killed past this summed RssAnon (the kernel's OOM killer, which is not as prompt, acts at the host's total)",
    )
    p.add_argument("--min-free-gib", type=float, default=40.0, help="free disk the run needs at --work")
    p.add_argument("--work", default=str(REPO / "bench_work"), help="scratch dir for the checkpoints")
    p.add_argument(
        "--out", default=str(REPO / "BENCHMARKS.md"), help="report whose section is (re)written; '' for none"
    )
    p.add_argument(
        "--readme", default=str(REPO / "README.md"), help="README whose headline rows are rewritten; '' for none"
    )
    p.add_argument("--json", default=str(REPO / "docs" / "bench_train_scale.json"), help="raw results; '' for none")
    p.add_argument(
        "--render", default=None, metavar="JSON", help="re-render --out and --readme from a --json file (no runs)"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in SAVE_MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; modes: {list(SAVE_MODES)}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    args.command = command(args, p)
    return args


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The command line of what was measured: the switches that change a run, not where it reports."""
    words = ["python -m scripts.bench.train_scale"]
    for flag in ("preset", "resume_ref", "repeats", "cap_gib"):
        value, default = getattr(args, flag), parser.get_default(flag)
        if value != default:
            words.append(f"--{flag.replace('_', '-')} {repr(value) if value == '' else value}")
    if args.modes != list(SAVE_MODES):
        words.append(f"--modes {','.join(args.modes)}")
    return " ".join(words)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.render:
        result = json.loads(Path(args.render).read_text())
    else:
        result = measure(args)
        if not result:
            return 0
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    section = render_section(result)
    if args.out:
        write_section(section, Path(args.out))
    if args.readme:
        write_readme(result, Path(args.readme))
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
