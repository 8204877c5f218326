"""A trainer's resume from booby-trapped checkpoints, through verl's real FSDPCheckpointManager
(gloo, CPU, FSDP2, a tiny Llama), run by tests/engine/test_pickle_policy.py:

    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.pickle_trap --dir D

Saves one step in each format a recipe resumes from (the incremental tier's dcp/ and verl's own rank
files, the latter under the quickstart recipe), with AdamW and with SGD (momentum) state, loads
each as saved (nothing may be refused), then loads copies trapped by slimckpt_testing/pickle_traps.py.
Rank 0 writes D/result.json: per case, what each rank's load raised and whether the marker exists.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from slimckpt_testing import pickle_traps
from slimckpt_testing.scenarios import tiny_run

# lazy imports: slimckpt's config and save path load inside the scenario, as verl's trainer loads them

TRAPS = {
    "incremental": ("metadata", "extra", "optim"),
    "native": ("model", "optim", "extra_state"),
}


def _config(fmt: str, **kw):
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    if fmt == "incremental":
        return tiny_run.slim_config(**kw)
    return SlimCheckpointConfig(recipe="quickstart", measure=False, **kw)


def _plant(fmt: str, kind: str, step: Path, marker: Path) -> None:
    if fmt == "incremental":
        {
            "metadata": pickle_traps.trap_metadata,
            "extra": pickle_traps.trap_extra,
            "optim": pickle_traps.trap_bytes_record,
        }[kind](step, marker)
    else:
        pickle_traps.trap_torch_file(step / f"{kind}_world_size_2_rank_0.pt", marker)


def _load(run, path: Path) -> str:
    try:
        run.manager.load_checkpoint(str(path))
        return "loaded"
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return f"{type(exc).__name__}: {exc}"


def _outcome(run, path: Path, marker: Path) -> dict:
    mine = _load(run, path)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    dist.barrier()
    return {"ranks": every, "marker": marker.exists()}


def _sgd(run) -> None:
    params = [p for p in run.model.parameters() if p.requires_grad]
    run.optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda s: 1.0)
    run.manager.optimizer, run.manager.lr_scheduler = run.optimizer, run.scheduler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    root = Path(args.dir)
    result: dict = {}
    from slimckpt.save.resume_state import finish_pending

    for fmt in TRAPS:
        run = tiny_run.Run(0, _config(fmt))
        for optim in ("adamw", "sgd"):
            if optim == "sgd":
                _sgd(run)
            run.step()
            clean = root / fmt / optim / "clean"
            run.manager.save_checkpoint(local_path=str(clean), global_step=1)
            finish_pending()
            dist.barrier()
            result[f"{fmt}/{optim}/clean"] = _outcome(run, clean, root / "never")
        clean = root / fmt / "sgd" / "clean"
        for kind in TRAPS[fmt]:
            step, marker = root / fmt / kind, root / fmt / f"{kind}.MARKER"
            if rank == 0:
                shutil.copytree(clean, step)
                _plant(fmt, kind, step, marker)
            dist.barrier()
            result[f"{fmt}/{kind}"] = _outcome(run, step, marker)
        if fmt == "native":  # the opt-out: the same trap runs (verl ignores the extra entry)
            step, marker = root / fmt / "extra_state_trusted", root / fmt / "extra_state_trusted.MARKER"
            if rank == 0:
                shutil.copytree(clean, step)
                _plant(fmt, "extra_state", step, marker)
            dist.barrier()
            run.manager.checkpoint_config = _config(fmt, trust_pickle=True)
            result[f"{fmt}/extra_state_trusted"] = _outcome(run, step, marker)
    if rank == 0:
        (root / "result.json").write_text(json.dumps(result, indent=1))
