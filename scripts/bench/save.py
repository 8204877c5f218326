#!/usr/bin/env python
"""Save benchmark: verl 0.9.1's own FSDPCheckpointManager save vs +recipe=incremental, same run.

  python -m scripts.bench.save                                   # 0.25b,0.5b,1b, 3 saves each -> BENCHMARKS.md
  python -m scripts.bench.save --sizes 0.25b --repeats 1 --out /tmp/b.md --json /tmp/b.json   # a quick look
  python -m scripts.bench.save --render /tmp/b.json --out BENCHMARKS.md                       # re-render, no runs
  python -m scripts.bench.save --sizes 0.25b --modes incremental,async,stream --tag stream-0.25b   # own section
  python -m scripts.bench.save --fsdp 1 --sizes 0.5b,1b --modes verl,incremental --tag fsdp1   # FSDP1 rows

For every size and mode one fresh `torchrun` (world size 2, FSDP2, gloo, CPU) builds a Llama of
slimckpt_testing.verl_checkpoints.fsdp_checkpoint's preset with random weights and a filled AdamW state, wraps it
like verl does (`fully_shard` per decoder layer, then the root; `--fsdp 1`: verl's strategy=fsdp,
FullyShardedDataParallel with a per-layer wrap policy) and saves it --repeats times
through verl 0.9.1's real `FSDPCheckpointManager.save_checkpoint`:

  verl         save_contents [model, optimizer, extra, hf_model] (verl's own code, SLIMCKPT_DISABLE=1):
               the sharded .pt files plus the hf_model gather on rank 0
  incremental  SlimCheckpointConfig(recipe=incremental, incremental_save, export_hf): DCP resume
               state streamed tensor by tensor, the gather-free HF export, manifest commit
  async        the same with async_save=true: staged into a host pool, written in the background
  stream       the same with async_save=stream: the live shards written in the background, no pool
               (no optimizer step between the saves: the rollout window here is longer than the write)

Measured per save and rank: peak anonymous RSS (RssAnon, sampled every 5 ms by a separate
process per rank, so a GIL-holding save cannot hide a spike) above the rank's level just before
the first save of the run (so a staging pool held between saves counts); wall time of the save
until every rank's files are committed (for async: until the background write is committed);
blocking time (until save_checkpoint returns). The report takes the largest peak over ranks and
saves, and medians of the times. Each save's directory is deleted before the next one.

The incremental modes use the actor checkpoint block of recipes/incremental.yaml unchanged
(export_hf, export_dtype, bucket_mb, write_threads, measure); in a tree whose incremental tier
refuses export_hf they run without the export, and the report says so.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench.rss_window import WindowSampler, sampler_main
from scripts.bench.save_report import MODES, SIZES, render_section, write_section
from scripts.provenance import source_commit

# lazy imports: torch, verl and slimckpt load in the worker ranks only; the driver and its RSS sampler stay torch-free

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- worker (one torchrun rank)


def build_model(preset: str, world: int, fsdp: int = 2, adamw_state: bool = True):
    """The preset's Llama, sharded like verl's FSDP2 wrap (or FSDP1's, `fsdp=1`); weights and AdamW
    state random and materialised (never zero pages, which would hide their RSS). `adamw_state=False`:
    an SGD optimizer without momentum (it has no state) for the lr scheduler, and no optimizer step,
    for sizes whose AdamW moments would not fit the host."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import PRESETS, build_config, wrap_fsdp2

    layers, hidden, inter, vocab, heads, kv = PRESETS[preset]
    cfg = argparse.Namespace(
        model="llama", layers=layers, hidden=hidden, intermediate=inter, vocab=vocab, heads=heads, kv_heads=kv
    )
    with torch.device("meta"):  # each rank materialises only its own shard
        model = AutoModelForCausalLM.from_config(build_config(cfg), dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    if fsdp == 1:
        model = wrap_fsdp1_from_meta(model, mesh)
    else:
        model = wrap_fsdp2(model, mesh, "dim0", world)
        model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1000 + torch.distributed.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).normal_(0.0, 0.02, generator=gen)
    if not adamw_state:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), n_params, vocab
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # one step on zero gradients creates the state without a forward pass
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for state in optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                local = state[key].to_local() if hasattr(state[key], "to_local") else state[key]
                local.normal_(0.0, 1e-3, generator=gen).abs_()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return model, optimizer, scheduler, n_params, vocab


def wrap_fsdp1_from_meta(model, mesh):
    """FSDP1 as slimckpt_testing.verl_checkpoints.fsdp_checkpoint.wrap_fsdp1 wraps it (use_orig_params, per-layer
    units, the mesh), materialising one unit at a time from the meta model: a rank never holds the
    whole unsharded model, as verl's rank 0 does not either."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import decoder_layer_classes

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=decoder_layer_classes(model))
    return FSDP(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        use_orig_params=True,
        device_id=torch.device("cpu"),
        device_mesh=mesh,
        param_init_fn=lambda m: m.to_empty(device=torch.device("cpu"), recurse=False),
    )


def preset_params(preset: str) -> int:
    """Parameters of the preset's Llama (embeddings untied), from its shape."""
    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import PRESETS

    layers, hidden, inter, vocab, heads, kv = PRESETS[preset]
    return (
        2 * vocab * hidden
        + hidden
        + layers * (2 * hidden * hidden + 2 * hidden * hidden * kv // heads + 3 * hidden * inter + 2 * hidden)
    )


def fsdp1_need(preset: str) -> int:
    """Host bytes an FSDP1 run of `preset` needs over all its ranks: the fp32 model and AdamW's two
    moments, and FSDP1's sharded state dict, a copy of them (gpu_check_fsdp), plus 2 GiB."""
    return 2 * 12 * preset_params(preset) + 2 * 2**30


def fsdp1_fits(preset: str) -> bool:
    return fsdp1_need(preset) <= mem_available()


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def staging_budget_gb(world: int) -> float:
    """async: what each rank may stage, from the memory this machine has free right now (less
    2 GiB), so a pool that cannot fit streams synchronously (and the report says so) instead of
    pushing a shared machine into the OOM killer."""
    return max(0.0, (mem_available() - 2 * 2**30) / world / 2**30)


def verl_contents(fsdp: int) -> list[str]:
    """verl's save_contents here. FSDP1: no hf_model, whose full state dict (offload_to_cpu,
    rank0_only) crashes torch on CPU/gloo; the row is verl's sharded save alone, its lower bound."""
    return ["model", "optimizer", "extra"] + (["hf_model"] if fsdp == 2 else [])


def checkpoint_config(mode: str, budget_gb: float, fsdp: int = 2):
    """(config, export_hf on?) for a mode. The incremental modes take the actor's checkpoint block of
    recipes/incremental.yaml as it is (export_hf, export_dtype, bucket_mb, ...) and set only
    async_save and the staging budget."""
    if mode == "verl":
        from omegaconf import OmegaConf

        return OmegaConf.create({"save_contents": verl_contents(fsdp)}), None
    from omegaconf import OmegaConf

    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    recipe = OmegaConf.load(REPO / "recipes" / "incremental.yaml").actor_rollout_ref.actor.checkpoint
    fields = {k: v for k, v in OmegaConf.to_container(recipe, resolve=True).items() if not k.startswith("_")}
    fields.update(async_save={"async": True, "stream": "stream"}.get(mode, False), host_memory_budget_gb=budget_gb)
    try:
        config = SlimCheckpointConfig(**fields)
    except ValueError as exc:  # a tree whose incremental tier has no HF export yet
        if "export" not in str(exc):
            raise
        fields.update(export_hf=False, export_dtype="bf16")
        config = SlimCheckpointConfig(**fields)
    return config, bool(config.export_hf)


def measured(sampler: WindowSampler, action, opened: str, closed: str, mark=None) -> dict:
    """`action()` on every rank in one sampled window, from a barrier to the barrier after every rank's
    action: the rank's RssAnon before and at its peak, the wall seconds, and what `action` returns (a
    dict). `mark(name)`: called with `opened` and `closed` as the window opens and closes."""
    import torch.distributed as dist

    gc.collect()
    os.sync()  # no dirty pages of earlier writes left for this window to wait on
    dist.barrier()
    level = sampler.start()
    if mark:
        mark(opened)
    t0 = time.perf_counter()
    got = action()
    dist.barrier()
    wall = time.perf_counter() - t0
    peak = sampler.stop()
    if mark:
        mark(closed)
    return {**got, "wall_s": wall, "level_before": level, "peak": peak}


def timed_save(manager, sampler: WindowSampler, path: str, step: int, mark=None) -> dict:
    """One save_checkpoint on every rank, waited for until committed (`measured`), and its blocking
    seconds: until save_checkpoint returned."""
    from slimckpt.save.resume_state import finish_pending

    def save() -> dict:
        t0 = time.perf_counter()
        manager.save_checkpoint(path, global_step=step)
        blocking = time.perf_counter() - t0
        finish_pending()
        return {"blocking_s": blocking}

    return measured(sampler, save, f"save-{step}", f"saved-{step}", mark)


def name_pretrained(model, out: str) -> None:
    """verl saves generation_config.json from config.name_or_path, as for a pretrained model: one made
    under `out` by rank 0."""
    import torch.distributed as dist

    gen_dir = os.path.join(out, "generation_config")
    if dist.get_rank() == 0:
        from transformers import GenerationConfig

        GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(gen_dir)
    dist.barrier()
    model.config.name_or_path = gen_dir


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import build_tokenizer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = WindowSampler()
    model, optimizer, scheduler, n_params, vocab = build_model(args.preset, world, args.fsdp)
    name_pretrained(model, args.out)
    dist.barrier()
    budget = [staging_budget_gb(world)]
    dist.broadcast_object_list(budget, src=0)  # one budget for all ranks: rank 0's view of the machine
    if rank == 0 and args.mode in ("async", "stream"):
        print(f"[bench-save] async staging budget {budget[0]:.1f} GiB per rank (free memory now)", flush=True)
    config, export_hf = checkpoint_config(args.mode, budget[0], args.fsdp)
    manager = FSDPCheckpointManager(
        model, optimizer, scheduler, processing_class=build_tokenizer(vocab), checkpoint_config=config
    )
    saves = []
    first_level = None
    for i in range(args.repeats):
        path = os.path.join(args.out, f"global_step_{i + 1}", "actor")
        save = timed_save(manager, sampler, path, i + 1)
        first_level = save["level_before"] if first_level is None else first_level
        if rank == 0:
            hf = Path(path) / "huggingface"
            save["hf_safetensors"] = len(list(hf.glob("*.safetensors"))) if hf.is_dir() else 0
            save["bytes_on_disk"] = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
            manifest = Path(path) / "slimckpt_resume.json"
            if manifest.exists():
                save["timings_s"] = json.loads(manifest.read_text()).get("extra", {}).get("timings_s", {})
        saves.append(save)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        dist.barrier()
    sampler.close()
    # the bound on a streaming save's extra host memory: write_threads x (bucket + largest shard) + 64 MiB
    largest = max(
        t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
        for t in [
            *model.parameters(),
            *(v for st in optimizer.state.values() for v in st.values() if hasattr(v, "numel")),
        ]
    )
    bound = (
        None
        if args.mode == "verl"
        else int(config.write_threads) * (int(config.bucket_mb) * 2**20 + largest) + 64 * 2**20
    )
    row = {
        "rank": rank,
        "world": world,
        "fsdp": args.fsdp,
        "params": n_params,
        "export_hf": export_hf,
        "export_dtype": None if args.mode == "verl" else str(config.export_dtype),
        "first_level": first_level,
        "saves": saves,
        "stream_bound": bound,
    }
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(args.out, "result.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver


def run_one(size: str, mode: str, args: argparse.Namespace, work: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"save-{size}-{mode}-", dir=work))
    log_path = work / f"save-{size}-{mode}.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(args.nproc),
        "-m",
        "scripts.bench.save",
        "--worker",
        "--mode",
        mode,
        "--preset",
        size,
        "--repeats",
        str(args.repeats),
        "--out",
        str(out),
        "--fsdp",
        str(args.fsdp),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "SLIMCKPT_LOG_LEVEL": "WARNING",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "patches"), os.environ.get("PYTHONPATH")])),
    }
    if mode == "verl":
        env["SLIMCKPT_DISABLE"] = "1"
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
            )
            try:
                code = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks: their own session
                proc.wait()
                raise SystemExit(
                    f"[bench-save] {size} {mode}: no result after {args.timeout} s; killed. "
                    f"Log: {log_path}; raise --timeout or use fewer --repeats"
                ) from None
        if code != 0:
            tail = log_path.read_text()[-3000:]
            raise SystemExit(f"[bench-save] {size} {mode} failed (exit {code}); log {log_path}:\n{tail}")
        ranks = json.loads((out / "result.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return summarise(size, mode, ranks)


def summarise(size: str, mode: str, ranks: list[dict]) -> dict:
    saves0 = ranks[0]["saves"]
    extra = [max(s["peak"] for s in r["saves"]) - r["first_level"] for r in ranks]
    return {
        "size": size,
        "mode": mode,
        "fsdp": ranks[0].get("fsdp", 2),
        "params": ranks[0]["params"],
        "export_hf": ranks[0]["export_hf"],
        "export_dtype": ranks[0].get("export_dtype"),
        "peak_extra_per_rank": extra,
        "peak_extra": max(extra),
        # one save in a fresh process, what `slimckpt plan` predicts; the later saves' peaks also
        # carry what the allocator kept of the earlier ones (verl's hf_model save: ~0.1-1.6 GiB)
        "first_save_extra_per_rank": [r["saves"][0]["peak"] - r["saves"][0]["level_before"] for r in ranks],
        "wall_s": statistics.median(max(r["saves"][i]["wall_s"] for r in ranks) for i in range(len(saves0))),
        "blocking_s": statistics.median(max(r["saves"][i]["blocking_s"] for r in ranks) for i in range(len(saves0))),
        "walls": [max(r["saves"][i]["wall_s"] for r in ranks) for i in range(len(saves0))],
        "blockings": [max(r["saves"][i]["blocking_s"] for r in ranks) for i in range(len(saves0))],
        "hf_safetensors": saves0[0].get("hf_safetensors", 0),
        "bytes_on_disk": saves0[0].get("bytes_on_disk", 0),
        "timings_s": [s.get("timings_s") for s in saves0],
        # async only: False when the pool was over the budget and the save streamed synchronously
        "staged": all("stage" in (s.get("timings_s") or {}) for s in saves0) if mode == "async" else None,
        "first_blocking_s": max(r["saves"][0]["blocking_s"] for r in ranks),
        "stream_bound": ranks[0].get("stream_bound"),
    }


def machine_line() -> str:
    import torch

    return (
        f"{platform.machine()}, {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
        f"torch {torch.__version__}"
    )


def driver(args: argparse.Namespace) -> int:
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [s for s in sizes if s not in SIZES] + [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"[bench-save] unknown size/mode {bad}; sizes: {list(SIZES)}, modes: {list(MODES)}")
    from tqdm import tqdm

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    commit = source_commit()  # the code the runs use: HEAD as they start
    rows = []
    skipped = [s for s in sizes if args.fsdp == 1 and not fsdp1_fits(s)]
    for size in skipped:
        print(
            f"[bench-save] {size} FSDP1: not run: its shards plus FSDP1's copy of them need about "
            f"{fsdp1_need(size) / 2**30:.1f} GiB, this machine has {mem_available() / 2**30:.1f} GiB available",
            flush=True,
        )
    sizes = [s for s in sizes if s not in skipped]
    if args.fsdp == 1 and skipped:
        args.note = (
            args.note + " " if args.note else ""
        ) + f"Not run (over this machine's available memory with FSDP1's copy): {', '.join(skipped)}."
    if not sizes:
        print("[bench-save] nothing to run: every size was skipped; the report is left as it is", flush=True)
        return 0
    runs = [(s, m) for s in sizes for m in modes]
    with tqdm(runs, desc="save bench", unit="run") as bar:
        for size, mode in bar:
            bar.set_postfix_str(f"{size} {mode}")
            row = run_one(size, mode, args, work)
            rows.append(row)
            tqdm.write(
                f"[bench-save] {size} {mode}: peak extra {row['peak_extra'] / 2**20:,.0f} MiB "
                f"(ranks {[round(v / 2**20) for v in row['peak_extra_per_rank']]}), wall {row['wall_s']:.1f} s, "
                f"blocking {row['blocking_s']:.2f} s, HF safetensors {row['hf_safetensors']}, "
                f"timings {row['timings_s'][-1]}"
            )
    command = (
        "python -m scripts.bench.save"
        + (f" --sizes {args.sizes}" if args.sizes != ",".join(SIZES) else "")
        + (f" --repeats {args.repeats}" if args.repeats != 3 else "")
    )
    command += f" --modes {args.modes}" if args.modes != ",".join(MODES) else ""
    command += f" --tag {args.tag}" if args.tag else ""
    command += f" --fsdp {args.fsdp}" if args.fsdp != 2 else ""
    result = {
        "rows": rows,
        "meta": {
            "command": command,
            "date": time.strftime("%Y-%m-%d"),
            "repeats": args.repeats,
            "seconds": time.time() - started,
            "machine": machine_line(),
            "tag": args.tag,
            "commit": commit,
            "note": args.note,
            "fsdp": args.fsdp,
        },
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    section = render_section(result)
    if args.out:
        write_section(section, Path(args.out))
    print(section)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(SIZES), help="comma-separated, from: " + ", ".join(SIZES))
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    p.add_argument("--repeats", type=int, default=3, help="saves per run; wall and blocking are their medians")
    p.add_argument("--nproc", type=int, default=2, help="ranks (world size)")
    p.add_argument(
        "--fsdp",
        type=int,
        choices=[1, 2],
        default=2,
        help="2: FSDP2 (fully_shard); 1: FSDP1 (FullyShardedDataParallel, verl's strategy=fsdp)",
    )
    p.add_argument("--timeout", type=int, default=900, help="seconds one torchrun may take before it is killed")
    p.add_argument("--work", default=str(REPO / "bench_work"), help="scratch dir for the checkpoints")
    p.add_argument(
        "--out", default=str(REPO / "BENCHMARKS.md"), help="report whose save-bench section is (re)written; '' for none"
    )
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument(
        "--tag",
        default="",
        help="write a section of its own (markers save-bench-TAG), e.g. for a run "
        "of some sizes or modes only, leaving the full section as it is",
    )
    p.add_argument("--note", default="", help="a paragraph under the section's targets")
    p.add_argument("--render", default=None, metavar="JSON", help="re-render --out from a --json file (no runs)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--sample-pid", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sample_pid:
        return sampler_main(args.sample_pid)
    if args.worker:
        worker(args)
        return 0
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.render:
        result = json.loads(Path(args.render).read_text())
        section = render_section(result)
        if args.out:
            write_section(section, Path(args.out))
        print(section)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
