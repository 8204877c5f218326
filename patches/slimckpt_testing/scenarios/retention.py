"""Retention of optimizer state and best steps through verl's real FSDPCheckpointManager (gloo, CPU,
FSDP2, a tiny Llama), run by tests/e2e/test_retention_disk.py under torchrun:

    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.retention --dir D --format incremental|verl

Five saves, one per trained step, with trainer.max_actor_ckpt_to_keep=2, keep_optimizer_last=1,
keep_best=1 by a metric recorded after each save the way the trainer's Tracking.log does, the
tracker moved after each save as verl's trainer does; a reader holds step 2 during the fourth save.
Then a fresh model resumes a step whose optimizer was dropped, and another the newest step. Writes
D/retention_<format>_result.json on rank 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch
import torch.distributed as dist

import slimckpt_testing.scenarios.tiny_run as tiny_run

# lazy imports: slimckpt's retention, locks and tracker load inside the scenario, after verl's manager

SCORES = {1: 0.9, 2: 0.1, 3: 0.2, 4: 0.3, 5: 0.4}  # step 1 is the best, and the oldest


def config(fmt: str):
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    keys = dict(keep_optimizer_last=1, keep_best=1, best_metric="val/score", best_mode="max", measure=False)
    if fmt == "incremental":
        return SlimCheckpointConfig(recipe="incremental", incremental_save=True, **keys)
    return SlimCheckpointConfig(
        recipe="quickstart",
        save_contents=["model", "optimizer", "extra"],
        load_contents=["model", "optimizer", "extra"],
        **keys,
    )


def on_disk(root: str) -> dict[str, bool]:
    """{global_step_N: whether its actor dir holds optimizer state} for every step on disk."""
    from slimckpt.save.retention.optimizer_drop import holds_optimizer

    return {
        name: holds_optimizer(os.path.join(root, name, "actor"))
        for name in sorted(os.listdir(root))
        if name.startswith("global_step_") and os.path.isdir(os.path.join(root, name, "actor"))
    }


def moment_size(optim: dict) -> float:
    """The largest |exp_avg| of an optimizer state dict: 0 for a fresh AdamW (nothing restored)."""
    values = [float(v["exp_avg"].abs().max()) for v in optim.get("state", {}).values() if "exp_avg" in v]
    return max(values, default=0.0)


def bytes_on_disk(root: str) -> dict[str, int]:
    out = {}
    for name in sorted(os.listdir(root)):
        actor = os.path.join(root, name, "actor")
        if os.path.isdir(actor):
            out[name] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(actor) for f in fs)
    return out


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--format", choices=["incremental", "verl"], required=True)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    from slimckpt.engine.resume_records import write_tracker
    from slimckpt.save.retention import best_metric
    from slimckpt.storage import locks

    lines = Lines()
    logging.getLogger("slimckpt").addHandler(lines)
    root = os.path.join(args.dir, args.format)
    rank = dist.get_rank()
    run = tiny_run.Run(seed=0, ckpt_config=config(args.format))
    after_save: dict[int, dict[str, list[str]]] = {}
    full_at: dict[int, dict] = {}
    reader_held = None
    for step in range(1, 6):
        run.step()
        path = os.path.join(root, f"global_step_{step}", "actor")
        if step == 4 and rank == 0:  # a `slimckpt merge` of step 2, say, while step 4 is saved
            reader_held = locks.reading(os.path.join(root, "global_step_2", "actor"), "merging it (test)")
            reader_held.__enter__()
        run.manager.save_checkpoint(path, global_step=step, max_ckpt_to_keep=2)
        dist.barrier()
        if rank == 0:
            if reader_held is not None:
                reader_held.__exit__(None, None, None)
                reader_held = None
            write_tracker(root, step)  # verl's trainer moves its tracker after the save
            best_metric.record(os.path.dirname(path), step, {"val/score": SCORES[step], "other": "text"})
            after_save[step] = on_disk(root)
        state = run.full_state()  # collective
        if rank == 0:
            full_at[step] = {k: v.clone() for k, v in state["model"].items()}
        dist.barrier()

    # a fresh model resumes step 1 (its optimizer was dropped): model-only, one line; then the
    # newest step 5, whole
    saving_lines = [x for x in lines.lines if "retention" in x]
    lines.lines.clear()
    torch.manual_seed(99)
    fresh = tiny_run.Run(seed=7, ckpt_config=config(args.format))
    fresh.manager.load_checkpoint(os.path.join(root, "global_step_1", "actor"))
    state = fresh.full_state()
    model_equal = tiny_run.tensors_equal(state["model"], full_at[1]) if rank == 0 else []
    moments = moment_size(state["optim"])
    dropped_lines = [line for line in lines.lines if "has no optimizer state" in line]
    fresh.step()  # trains on from there (a fresh AdamW)

    whole = tiny_run.Run(seed=8, ckpt_config=config(args.format))
    whole.manager.load_checkpoint(os.path.join(root, "global_step_5", "actor"))
    state5 = whole.full_state()
    model5_equal = tiny_run.tensors_equal(state5["model"], full_at[5]) if rank == 0 else []
    if rank == 0:
        with open(os.path.join(args.dir, f"retention_{args.format}_result.json"), "w") as f:
            json.dump(
                {
                    "after_save": after_save,
                    "final": on_disk(root),
                    "model_equal_diffs": model_equal,
                    "adam_moments_after_model_only": moments,
                    "dropped_lines": dropped_lines,
                    "model5_diffs": model5_equal,
                    "adam_moments_after_whole": moment_size(state5["optim"]),
                    "bytes": bytes_on_disk(root),
                    "retention_lines": saving_lines,
                },
                f,
                indent=1,
            )
    from slimckpt.save.resume_state import finish_pending

    finish_pending()
