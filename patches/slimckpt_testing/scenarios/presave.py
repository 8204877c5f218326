"""torchrun scenario (run by slimckpt_testing/scenarios/batch.py as `presave` on FSDP2 and `presave_fsdp1`) for
tests/save/test_resume_state.py: a save before the optimizer's first step, through verl's real
FSDPCheckpointManager, as an actor saves during PPO's `trainer.critic_warmup`.

verl's own save is the reference: it saves step 0 before any update, trains STEPS steps, and a
fresh model that loads its step 0 trains the same STEPS. Then +recipe=incremental's checkpoint
block (export on) in every save mode does the same; each records what the optimizer looked like
before and after its save (state entries, step counts, grads, lr, the parameters' bytes), the
losses of the saving run and of the resumed run, and the verify and merge of its step 0 (rank 0).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import slimckpt_testing.scenarios.tiny_run as tiny_run  # the tiny model's Run and the slimckpt config

# lazy imports: verl and slimckpt's save path load inside the scenario, after the batch set the module settings they read

STEPS = 3
MODES = {"sync": False, "pool": True, "stream": "stream"}


def optimizer_view(run: tiny_run.Run) -> dict:
    """What a save must not change: the optimizer's state, its step counts, every grad, the lr and
    the parameters."""
    steps = sorted({int(s["step"]) for s in run.optimizer.state.values() if "step" in s})
    local = [(p.to_local() if hasattr(p, "to_local") else p) for p in run.model.parameters()]
    return {
        "state_entries": len(run.optimizer.state),
        "steps": steps,
        "grads": sum(p.grad is not None for p in run.model.parameters()),
        "lr": [g["lr"] for g in run.optimizer.param_groups],
        "params": [float(t.detach().double().sum()) for t in local],
        "params_bytes": [bytes(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hex()[:64] for t in local],
    }


def _verify_and_merge(path: str, out: str) -> dict:
    from slimckpt.merge.pipeline import merge
    from slimckpt.merge.plan import MergeOptions
    from slimckpt.verify.command import verify_path

    report = verify_path(path)
    merged = merge(MergeOptions(local_dir=path, target_dir=out, dtype="fp32", progress=False))
    return {
        "verify_ok": report.ok,
        "verify_bad": [p.message for p in report.bad],
        "merged": sorted(os.listdir(merged.target_dir)),
    }


def _save_train_resume(config, root: str, fresh_config) -> dict:
    from slimckpt.save.resume_state import finish_pending

    path = os.path.join(root, "global_step_0", "actor")
    run = tiny_run.Run(seed=0, ckpt_config=config)
    before = optimizer_view(run)
    run.manager.save_checkpoint(path, global_step=0)
    after = optimizer_view(run)
    losses = [run.step() for _ in range(STEPS)]
    finish_pending()
    resumed = tiny_run.Run(seed=1, ckpt_config=fresh_config)
    resumed.manager.load_checkpoint(path)
    loaded = optimizer_view(resumed)
    resumed_losses = [resumed.step() for _ in range(STEPS)]
    return {
        "before": before,
        "after": after,
        "loaded": loaded,
        "losses": losses,
        "resumed": resumed_losses,
        "path": path,
    }


def scenario(args) -> None:
    from verl.trainer.config import CheckpointConfig

    from slimckpt.verl.recipes import recipe_checkpoint_config

    result = {"verl": _save_train_resume(CheckpointConfig(), os.path.join(args.dir, "verl"), CheckpointConfig())}
    for name, mode in MODES.items():
        fields = {"async_save": mode, "measure": False, "host_memory_budget_gb": 1.0}
        config = recipe_checkpoint_config("incremental", **fields)
        r = _save_train_resume(
            config,
            os.path.join(args.dir, name),
            recipe_checkpoint_config("incremental", **{**fields, "async_save": False}),
        )
        r["export_hf"] = bool(config.export_hf)
        if dist.get_rank() == 0:
            r.update(_verify_and_merge(r["path"], os.path.join(args.dir, f"{name}_merged")))
        dist.barrier()
        result[name] = r
    tiny_run.write_result(args, "presave", result)
