"""Peak anonymous RSS and time of one save through verl's FSDPCheckpointManager: verl's own save
vs the incremental tier (sync and async), same model, same ranks, on this machine (CPU, gloo).

    python scripts/measure_resume_save.py [--preset 0.25b] [--nproc 2] [--repeats 3] [--fsdp 2]

Each (mode, repeat) is a fresh `torchrun` (no allocator state carried over): build the model from
slimckpt.testing.fsdp_checkpoint's preset, one AdamW step (so the optimizer holds real state),
then RssSampler (5 ms) around `manager.save_checkpoint`; for async also until the background
write is committed. Prints one JSON line per run and a table of medians (per-rank peak RssAnon
above the level just before the save).

What CPU cannot show: with tensors on an accelerator, verl's save first copies every shard of
the rank into host RAM (offload_to_cpu=True), which is where the incremental tier's streaming
differs most; here the tensors already live in host RAM, so neither path copies them wholesale.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("verl", "incremental", "async")


def worker(args: argparse.Namespace) -> None:
    import gc

    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    from slimckpt.memory import RssSampler, rss_anon_bytes
    from slimckpt.testing.fsdp_checkpoint import PRESETS, build_config, train_steps, wrap_fsdp1, wrap_fsdp2

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layers, hidden, inter, vocab, heads, kv = PRESETS[args.preset]
    cfg = argparse.Namespace(model="llama", layers=layers, hidden=hidden, intermediate=inter, vocab=vocab,
                             heads=heads, kv_heads=kv)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(cfg), dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = wrap_fsdp2(model, mesh, "dim0", world) if args.fsdp == 2 else wrap_fsdp1(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    train_steps(model, optimizer, vocab, 1, 0)
    if args.mode == "verl":
        ckpt = OmegaConf.create({"save_contents": ["model", "optimizer", "extra"]})
    else:
        from slimckpt.config import SlimCheckpointConfig

        ckpt = SlimCheckpointConfig(recipe="incremental", incremental_save=True, measure=False,
                                    async_save=args.mode == "async", host_memory_budget_gb=64.0)
    manager = FSDPCheckpointManager(model, optimizer, scheduler, checkpoint_config=ckpt)
    gc.collect()
    dist.barrier()
    before = rss_anon_bytes()
    t0 = time.perf_counter()
    with RssSampler() as sampler:
        manager.save_checkpoint(os.path.join(args.out, "global_step_1", "actor"), global_step=1)
        blocking = time.perf_counter() - t0
        from slimckpt.resume_state import finish_pending

        finish_pending()
        dist.barrier()
    total = time.perf_counter() - t0
    row = {"mode": args.mode, "rank": rank, "world": world, "params": n_params, "fsdp": args.fsdp,
           "rss_before_bytes": before, "peak_extra_bytes": sampler.result.extra,
           "blocking_s": blocking, "total_s": total}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(os.path.join(args.out, "measure.json"), "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def driver(args: argparse.Namespace) -> int:
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            with tempfile.TemporaryDirectory(prefix="slimckpt-measure-", dir=args.work) as out:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                       str(args.nproc), __file__, "--worker", "--mode", mode, "--out", out, "--preset", args.preset,
                       "--fsdp", str(args.fsdp)]
                env = {**os.environ, "SLIMCKPT_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
                if proc.returncode != 0:
                    print(proc.stderr[-4000:], file=sys.stderr)
                    return proc.returncode
                with open(os.path.join(out, "measure.json")) as f:
                    rows = json.load(f)
            for row in rows:
                print(json.dumps({**row, "repeat": repeat}), flush=True)
            results[mode].append(rows)
    print(f"\nmedians over {args.repeats} runs, preset {args.preset}, {args.nproc} ranks, FSDP{args.fsdp} "
          f"({results['verl'][0][0]['params']:,} params):")
    print(f"{'mode':<12} {'rank':>4} {'peak RssAnon above pre-save':>28} {'blocking s':>11} {'total s':>8}")
    for mode in MODES:
        for rank in range(args.nproc):
            runs = [rows[rank] for rows in results[mode]]
            peak = statistics.median(r["peak_extra_bytes"] for r in runs) / 2**20
            print(f"{mode:<12} {rank:>4} {peak:>24.1f} MiB {statistics.median(r['blocking_s'] for r in runs):>11.2f} "
                  f"{statistics.median(r['total_s'] for r in runs):>8.2f}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="0.25b", help="slimckpt.testing.fsdp_checkpoint PRESETS key")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fsdp", type=int, choices=[1, 2], default=2)
    p.add_argument("--work", default=None, help="where the checkpoints are written (default: the temp dir)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
