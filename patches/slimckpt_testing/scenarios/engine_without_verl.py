"""The checkpoint engine saves and resumes an FSDP2 model for a caller that is not verl, in a process
where verl, Ray, omegaconf and hydra cannot be imported; run by tests/save/test_engine_without_verl.py:

    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.engine_without_verl --dir D

Per async mode (off, pool, stream), with a fresh model: one optimizer step, a save of step 1 through
`save.step_save.save_resume_state` with a SaveTarget built here, a second step (the live shards move on),
then `save.resume_load.load_resume_state` into the same model: the model's shards, the optimizer's state
and the lr scheduler must equal what was saved, bit for bit. Rank 0 writes D/engine_result.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import slimckpt.save.modes.writer as resume_async
from slimckpt.layout.resume_manifest import MANIFEST_NAME
from slimckpt.options.checkpoint_options import CheckpointOptions
from slimckpt.resume.load import load_resume_state
from slimckpt.save.step_save import save_resume_state
from slimckpt.save.target import SaveTarget, TargetState, fsdp_version_of

STACK = ("verl", "ray", "omegaconf", "hydra")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(3)], torch.nn.Linear(24, 7))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model


def _step(model, optimizer, scheduler, seed: int) -> None:
    torch.manual_seed(seed + dist.get_rank())
    model(torch.randn(5, 24)).square().mean().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _locals(model, optimizer) -> dict[str, torch.Tensor]:
    out = {f"p/{n}": p.to_local().detach().clone() for n, p in model.named_parameters()}
    for i, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[f"o/{i}/{key}"] = local.detach().clone()
    return out


def _one_mode(root: str, mode: str) -> dict:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    options = CheckpointOptions(recipe="incremental", incremental_save=True, async_save=mode, measure=False)
    state = TargetState()

    def target() -> SaveTarget:
        return SaveTarget(
            model=model,
            optimizer=optimizer,
            options=options,
            state=state,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            lr_scheduler=scheduler,
            fsdp_version=fsdp_version_of(model),
            get_rng_state=torch.get_rng_state,
            load_rng_state=torch.set_rng_state,
        )

    _step(model, optimizer, scheduler, 1)
    saved, saved_lr = _locals(model, optimizer), scheduler.get_last_lr()
    path = os.path.join(root, mode, "global_step_1", "actor")
    save_resume_state(target(), path, 1)
    _step(model, optimizer, scheduler, 2)  # in stream mode, the guard lets the writer read the saved values first
    resume_async.writer_for(state).wait()
    moved = _locals(model, optimizer)
    load_resume_state(target(), path)
    loaded = _locals(model, optimizer)
    return {
        "committed": os.path.exists(os.path.join(path, MANIFEST_NAME)),
        "moved": any(not torch.equal(saved[k], moved[k]) for k in saved),
        "equal": sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved),
        "lr_equal": scheduler.get_last_lr() == saved_lr,
        "fsdp_version": fsdp_version_of(model),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    blocked = []
    for name in STACK:
        try:
            __import__(name)
        except ModuleNotFoundError:
            blocked.append(name)
    result = {mode: _one_mode(args.dir, mode) for mode in ("off", "pool", "stream")}
    gc.collect()  # the FSDP models live in reference cycles: freed here, before the group is destroyed
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in STACK)
    outcome = {"ranks": dist.get_world_size(), "modes": result, "blocked": blocked, "stack_loaded": loaded}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome)
    if dist.get_rank() == 0:
        with open(os.path.join(args.dir, "engine_result.json"), "w") as f:
            json.dump(gathered, f)
