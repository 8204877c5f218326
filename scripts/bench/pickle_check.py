#!/usr/bin/env python
"""What slimckpt's pickle check (slimckpt.engine.pickle_policy) costs a merge and a resume, same run.

  torchrun --nproc_per_node 2 -m scripts.bench.pickle_check --out /tmp/pc --size-preset 0.25b --repeats 3

Saves one step of a Llama (FSDP2, gloo, CPU, AdamW state after one step) through verl's real
FSDPCheckpointManager twice: verl's own format (the quickstart recipe) and the incremental tier's
dcp/. Then, --repeats times, alternating: `slimckpt merge` of each (a subprocess started by rank 0,
page cache warm), and `load_checkpoint` of each on both ranks; each once checked (the default)
and once with SLIMCKPT_TRUST_PICKLE=1, which skips every check (what the code did before). Prints
the median and least seconds of each (checked first in odd repeats, trusted first in even ones)
and writes them to <out>/pickle_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from slimckpt.engine.pickle_policy import TRUST_ENV

# lazy imports: verl, transformers and slimckpt's save path load on each rank, inside the measured run


def _run(args):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import PRESETS, build_config, build_tokenizer, wrap_fsdp2

    layers, hidden, inter, vocab, heads, kv = PRESETS[args.size_preset]
    cfg = build_config(
        SimpleNamespace(
            model="llama",
            vocab=vocab,
            hidden=hidden,
            intermediate=inter,
            layers=args.layers or layers,
            heads=heads,
            kv_heads=kv,
            experts=0,
        )
    )
    torch.manual_seed(0)
    world = dist.get_world_size()
    model = wrap_fsdp2(AutoModelForCausalLM.from_config(cfg), init_device_mesh("cpu", (world,)), "dim0", world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ids = torch.randint(0, vocab, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    return SimpleNamespace(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        vocab=vocab,
        manager=lambda config: FSDPCheckpointManager(
            model, optimizer, scheduler, processing_class=build_tokenizer(vocab), checkpoint_config=config
        ),
    )


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--size-preset", default="0.25b")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    from slimckpt.save.resume_state import finish_pending
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    run = _run(args)
    configs = {
        "native": SlimCheckpointConfig(recipe="quickstart", measure=False),
        "incremental": SlimCheckpointConfig(recipe="incremental", incremental_save=True, measure=False),
    }
    managers = {fmt: run.manager(cfg) for fmt, cfg in configs.items()}
    for fmt, manager in managers.items():
        if rank == 0:
            shutil.rmtree(out / fmt, ignore_errors=True)
        dist.barrier()
        manager.save_checkpoint(local_path=str(out / fmt), global_step=1)
        finish_pending()
    times: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        for checked in (True, False) if repeat % 2 == 0 else (False, True):  # neither always goes first
            mode = "checked" if checked else "trusted"
            if checked:
                os.environ.pop(TRUST_ENV, None)
            else:
                os.environ[TRUST_ENV] = "1"
            for fmt, manager in managers.items():
                times.setdefault(f"load/{fmt}/{mode}", []).append(
                    _timed(lambda: manager.load_checkpoint(str(out / fmt)))
                )
                target = out / f"merged_{fmt}"

                def merge() -> None:
                    if rank == 0:
                        shutil.rmtree(target, ignore_errors=True)
                        proc = subprocess.run(
                            [
                                sys.executable,
                                "-m",
                                "slimckpt.cli",
                                "merge",
                                "--no_progress",
                                "--local_dir",
                                str(out / fmt),
                                "--target_dir",
                                str(target),
                            ],
                            capture_output=True,
                            text=True,
                            env=dict(os.environ),
                        )
                        assert proc.returncode == 0, proc.stderr[-2000:]

                times.setdefault(f"merge/{fmt}/{mode}", []).append(_timed(merge))
    os.environ.pop(TRUST_ENV, None)
    if rank == 0:
        medians = {k: round(statistics.median(v), 3) for k, v in sorted(times.items())}
        report = {
            "size_preset": args.size_preset,
            "layers": args.layers,
            "repeats": args.repeats,
            "median_s": medians,
            "min_s": {k: round(min(v), 3) for k, v in sorted(times.items())},
            "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
        }
        (out / "pickle_check.json").write_text(json.dumps(report, indent=1))
        for k, v in medians.items():
            print(f"{k:32s} median {v:8.3f} s  min {report['min_s'][k]:8.3f} s  runs {report['all_s'][k]}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
