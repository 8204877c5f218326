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
from scripts.provenance import source_commit

# lazy imports: torch, verl and slimckpt load in the worker ranks only; the driver stays torch-free

REPO = Path(__file__).resolve().parents[2]
GiB, MiB, GB = 2**30, 2**20, 10**9
BEGIN, END = "<!-- train-scale:begin -->", "<!-- train-scale:end -->"
README_BEGIN, README_END = "<!-- train-scale-headline:begin -->", "<!-- train-scale-headline:end -->"
PICTURE = "![the job's anonymous memory during one save](docs/save_rss_timeline.png)"
SAVE_MODES = ("verl", "intermediate", "incremental", "stream")
RESUME_MODES = ("verl-resume", "incremental")
LABEL = {
    "verl": "verl 0.9.1 (`hf_model`)",
    "verl-resume": "verl 0.9.1 (model, extra)",
    "intermediate": "`+recipe=intermediate`",
    "incremental": "`+recipe=incremental`",
    "stream": "`+recipe=incremental`, async_save=stream",
}
EVENT = re.compile(r"\[train-scale\] event (\S+) (\d+\.\d+)")
KERNEL_KILL = re.compile(r"exitcode\s*:\s*-9|Signals\.SIGKILL|signal 9", re.IGNORECASE)
# the tier's load holds one bucket of this size per rank (recipes/incremental.yaml's bucket_mb)
LOAD_SLACK = 64 * MiB
SAVE_TARGET = 64 * MiB


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

    from scripts.bench.save import WindowSampler, build_model, measured, name_pretrained, timed_save
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


# --------------------------------------------------------------------------- report


def _mib(v: float) -> str:
    return f"{v / MiB:,.0f} MiB"


def when_killed(row: dict) -> str:
    """ "killed 31 s into the save", from the last event the run printed before its kill."""
    during = {"load": "the load", "built": "start-up, after the build", "start-up": "start-up"}.get(
        row["killed_in"], "the save" if row["killed_in"].startswith("save-") else row["killed_in"]
    )
    if row.get("killed_after_s") is None:
        return f"killed {row['killed_at_s']:.0f} s after its start, in {during}"
    return f"killed {row['killed_after_s']:.0f} s into {during}"


def killer(row: dict) -> str:
    return "killed by the kernel's OOM killer" if row.get("killed_by", "the cap").startswith("the kernel") else "cap"


def outcome(row: dict) -> str:
    if row["killed"]:
        return f"{when_killed(row)}, the job's RssAnon at {row['tree_peak'] / GiB:.1f} GiB"
    per_rank = " / ".join(_mib(v) for v in row["save_extra_per_rank"])
    return f"extra {per_rank} (rank 0 / rank 1), wall {row['wall_s']:.1f} s, blocking {row['blocking_s']:.1f} s"


def load_words(row: dict) -> str:
    load = row["load"]
    return (
        f"extra {' / '.join(_mib(v) for v in load['extra_per_rank'])}, wall {load['wall_s']:.1f} s, "
        f"shards {'equal' if load['equal'] else 'DIFFERENT'}"
    )


def find(rows: list[dict], preset: str, mode: str, resume: bool = False) -> dict | None:
    return next(
        (r for r in rows if r["preset"] == preset and r["mode"] == mode and (not resume or "load" in r or r["killed"])),
        None,
    )


def resume_rows(rows: list[dict], preset: str) -> list[dict]:
    return [r for r in rows if r["preset"] == preset and r["mode"] in RESUME_MODES and (r.get("load") or r["killed"])]


def verl_need_words(meta: dict, mode: str, row: dict | None = None) -> str:
    """What verl's path needs on top of the model the ranks hold, from its code: hf_model gathers every
    parameter in fp32 on rank 0; its load torch.loads each rank's whole shard file before copying it in."""
    model = meta["params"] * 4
    load = f"its load reads each rank's whole shard file ({model / 2 / GB:.1f} GB) into memory before copying it in"
    if mode == "verl":
        return f"its `hf_model` save gathers the whole fp32 model ({model / GB:.1f} GB) on rank 0"
    if row is not None and row.get("killed_in", "").startswith("save-"):
        return (
            f"its own save of the files to resume from (`[model, extra]`) did not finish, so its load never ran; {load}"
        )
    return load


def save_table(result: dict) -> str:
    rows, meta = result["rows"], result["meta"]
    lines = [
        "| save | extra RssAnon, rank 0 / rank 1 (peak) | the job's RssAnon (peak) | wall (median) | blocking | HF safetensors | on disk |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in SAVE_MODES:
        r = find(rows, meta["preset"], mode)
        if r is None:
            continue
        if r["killed"]:
            lines.append(
                f"| {LABEL[mode]} | {when_killed(r)}: {verl_need_words(meta, mode, r)} "
                f"| {r['tree_peak'] / GiB:.1f} GiB ({killer(r)}) | - | - | - | - |"
            )
            continue
        lines.append(
            f"| {LABEL[mode]} | {' / '.join(_mib(v) for v in r['save_extra_per_rank'])} | {r['tree_peak'] / GiB:.1f} GiB "
            f"| {r['wall_s']:.1f} s | {r['blocking_s']:.1f} s | {r['hf_safetensors'] or 'none'} | {r['bytes_on_disk'] / GB:.1f} GB |"
        )
    return "\n".join(lines)


def resume_table(result: dict) -> str:
    rows, meta = result["rows"], result["meta"]
    lines = [
        "| model | load | extra RssAnon, rank 0 / rank 1 (peak) | the job's RssAnon (peak) | wall | shards equal to the saved ones |",
        "|---|---|---|---|---|---|",
    ]
    for preset in dict.fromkeys([meta["preset"], meta.get("resume_ref") or meta["preset"]]):
        for r in resume_rows(rows, preset):
            name = f"{preset} ({r['params'] / 1e9:.2f}B)" if r.get("params") else preset
            what = (
                "verl 0.9.1's load of its files"
                if r["mode"] == "verl-resume"
                else "the incremental tier's load of its step"
            )
            if r["killed"]:
                lines.append(
                    f"| {name} | {what} | {when_killed(r)}: {verl_need_words(meta, r['mode'], r)} | {r['tree_peak'] / GiB:.1f} GiB ({killer(r)}) | - | - |"
                )
                continue
            load = r["load"]
            lines.append(
                f"| {name} | {what} | {' / '.join(_mib(v) for v in load['extra_per_rank'])} | {r['tree_peak'] / GiB:.1f} GiB "
                f"| {load['wall_s']:.1f} s | {'yes' if load['equal'] else 'NO'} |"
            )
    return "\n".join(lines)


def targets(result: dict) -> list[tuple[str, bool, str]]:
    rows, meta = result["rows"], result["meta"]
    big = meta["preset"]
    checks = []
    for mode in ("intermediate", "incremental", "stream"):
        r = find(rows, big, mode)
        if r is None:
            continue
        worst = None if r["killed"] else max(r["save_extra_per_rank"])
        checks.append(
            (
                f"{LABEL[mode]} save: extra RssAnon <= 64 MiB per rank ({big})",
                worst is not None and worst <= SAVE_TARGET,
                outcome(r) if worst is None else _mib(worst),
            )
        )
    verl = find(rows, big, "verl")
    if verl:
        checks.append(
            (
                f"verl's `hf_model` save killed or its peak stated ({big})",
                True,
                outcome(verl) if verl["killed"] else f"peak extra {_mib(max(verl['save_extra_per_rank']))}",
            )
        )
    for preset in dict.fromkeys([big, meta.get("resume_ref") or big]):
        ours = next((r for r in resume_rows(rows, preset) if r["mode"] == "incremental"), None)
        theirs = next((r for r in resume_rows(rows, preset) if r["mode"] == "verl-resume"), None)
        if ours is None or ours["killed"]:
            if ours is not None:
                checks.append((f"incremental load finished ({preset})", False, outcome(ours)))
            continue
        worst = max(ours["load"]["extra_per_rank"])
        checks.append(
            (
                f"incremental load: extra RssAnon <= one bucket (64 MiB) + 64 MiB per rank, shards equal ({preset})",
                worst <= 64 * MiB + LOAD_SLACK and ours["load"]["equal"],
                f"{_mib(worst)}, {'equal' if ours['load']['equal'] else 'DIFFERENT'}",
            )
        )
        if theirs is not None:
            ok = theirs["killed"] or ours["load"]["wall_s"] <= theirs["load"]["wall_s"]
            value = (
                f"{ours['load']['wall_s']:.1f} s; verl's load killed"
                if theirs["killed"]
                else f"{ours['load']['wall_s']:.1f} s vs {theirs['load']['wall_s']:.1f} s"
            )
            checks.append((f"incremental load wall <= verl's ({preset})", ok, value))
    return checks


def render_section(result: dict) -> str:
    meta = result["meta"]
    checks = targets(result)
    target_lines = ["| target | met | measured |", "|---|---|---|"]
    target_lines += [f"| {name} | {'✓' if ok else '✗'} | {value} |" for name, ok, value in checks]
    cap_note = f" ({meta['cap_note']})" if meta.get("cap_note") else ""
    return f"""{BEGIN}
## Save and resume inside verl at {meta["params"] / 1e9:.2f}B: FSDP2, world size 2, verl 0.9.1's FSDPCheckpointManager

Produced by `{meta["command"]}` on {meta["date"]} at commit {meta["commit"]}, in {meta["seconds"] / 60:.1f} minutes.
Machine: {meta["machine"]}, {meta["available_gib"]:.1f} GiB available at the end.
A Llama of preset `{meta["preset"]}` ({meta["shape"]}, embeddings untied), random fp32 weights, sharded over two ranks (FSDP2, gloo, CPU): the model alone is
{meta["params"] * 4 / GB:.1f} GB of the host's memory. No optimizer state is saved (AdamW's moments would need
{meta["params"] * 8 / GB:.1f} GB more than this host has): each save is `[model, extra]` (intermediate: its recipe's
`[model]`), the optimizer SGD without momentum. Each row is one fresh `torchrun`, its process tree killed as
soon as its summed anonymous RSS passes {meta["cap"] / GiB:.1f} GiB{cap_note}, as the OOM killer would. Extra RssAnon: each
rank's peak during the save (or load) above its level just before it, sampled every 5 ms from a separate
process; the job's RssAnon: the whole tree's (ranks, torchrun, samplers), model included. Saves per run:
{meta["repeats"]}; wall until every rank's files are committed. verl runs its own code (`SLIMCKPT_DISABLE=1`).

{save_table(result)}

Resume: after its last save, each run scrambles its shards and loads the step back; the loads read from
disk (the step's files dropped from the page cache first), and every rank's shards are compared byte for
byte with the saved ones after the load. The incremental tier's load checksums every file of the step
before it reads it (`verify: true`, the recipe's default), so it reads the step from disk twice; verl's
load reads its files once and checks nothing.

{resume_table(result)}

{PICTURE}

### Targets

{chr(10).join(target_lines)}
{END}
"""


def headline(result: dict) -> str:
    """README's rows at this size."""
    rows, meta = result["rows"], result["meta"]
    big, size = meta["preset"], f"{meta['params'] / 1e9:.2f}B"
    verl, ours = find(rows, big, "verl"), find(rows, big, "incremental")
    link = (
        "[BENCHMARKS.md](BENCHMARKS.md#save-and-resume-inside-verl-at-"
        + size.replace(".", "").lower()
        + "-fsdp2-world-size-2-verl-091s-fsdpcheckpointmanager)"
    )
    lines = [
        f"| inside training (`make bench-train-scale`, {meta['date']}; FSDP2, model and extra state) | verl 0.9.1 | slimckpt |",
        "|---|---|---|",
    ]
    if verl and ours and not ours["killed"]:
        theirs = (
            f"{when_killed(verl)} at {verl['tree_peak'] / GiB:.0f} GiB for the job (`hf_model`)"
            if verl["killed"]
            else f"{_mib(verl['save_extra_per_rank'][0])}, {verl['wall_s']:.1f} s (`hf_model`)"
        )
        lines.append(
            f"| save with a Hugging Face export, {size} model, 2 ranks: extra host memory of rank 0, save time ({link}) "
            f"| {theirs} | {_mib(ours['save_extra_per_rank'][0])}, {ours['wall_s']:.1f} s (`+recipe=incremental`) |"
        )
    theirs = next((r for r in resume_rows(rows, big) if r["mode"] == "verl-resume"), None)
    if ours and ours.get("load") and theirs:
        verl_words = (
            f"{when_killed(theirs)} at {theirs['tree_peak'] / GiB:.0f} GiB for the job"
            if theirs["killed"]
            else f"{_mib(theirs['load']['extra_per_rank'][0])}, {theirs['load']['wall_s']:.1f} s"
        )
        lines.append(
            f"| resume the {size} model from its last step: extra host memory of rank 0, load time ({link}) "
            f"| {verl_words} | {_mib(ours['load']['extra_per_rank'][0])}, {ours['load']['wall_s']:.1f} s |"
        )
    return "\n".join(lines)


def write_readme(result: dict, path: Path) -> None:
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise SystemExit(f"[bench-train-scale] {path} has no {README_BEGIN} ... {README_END} markers for its rows")
    head, rest = text.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    path.write_text(f"{head}{README_BEGIN}\n{headline(result)}\n{README_END}{tail}")


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
