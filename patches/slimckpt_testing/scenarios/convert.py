"""Multi-process scenarios for `slimckpt convert`, run by tests/convert/test_convert.py under torchrun (gloo,
CPU, a tiny Llama) through verl's real FSDPCheckpointManager:

    torchrun --nproc_per_node N -m slimckpt_testing.launch slimckpt_testing.scenarios.convert save --dir D [--fsdp 1|2]
        train 3 steps; save step 3 as +recipe=incremental does (D/ours) and as verl does (D/verl),
        with the tracker; dump the full state (D/full_state.pt); train 3 more steps (the reference)
    SLIMCKPT_DISABLE=1 torchrun --nproc_per_node M -m slimckpt_testing.launch slimckpt_testing.scenarios.convert resume --dir D \
            --name X --case NAME:SAVED:ROOT [--case ...]
        unpatched verl, for each case: find the step the tracker of ROOT names (verl's own
        find_latest_ckpt_path), load it, compare the full state with SAVED/full_state.pt, train 3 steps

Each writes D/<scenario>_ws<world>_result.json on rank 0; the test asserts on it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch
import torch.distributed as dist

import slimckpt_testing.scenarios.tiny_run as tiny_run  # the same model, optimizer and training step

# lazy imports: verl and slimckpt's modules load inside a scenario (resume runs verl unpatched)
SAVE_STEP, STEPS_AFTER = 3, 3


def _full_state(run) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    # FSDP1's full state dict with cpu_offload fails on gloo: gathered without offload, copied here
    opts = StateDictOptions(full_state_dict=True, cpu_offload=tiny_run.FSDP_VERSION == 2)
    model = get_model_state_dict(run.model, options=opts)
    optim = get_optimizer_state_dict(run.model, run.optimizer, options=opts)
    return {"model": model, "optim": optim, "scheduler": run.scheduler.state_dict()}


def write_result(args, name: str, result: dict) -> None:
    if dist.get_rank() == 0:
        with open(os.path.join(args.dir, f"{name}_ws{dist.get_world_size()}_result.json"), "w") as f:
            json.dump(result, f, indent=1)


def scenario_save(args) -> None:
    from verl.trainer.config import CheckpointConfig
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    from slimckpt.engine.resume_records import write_tracker
    from slimckpt.save.resume_state import finish_pending

    run = tiny_run.Run(seed=0, ckpt_config=tiny_run.slim_config())
    for _ in range(3):
        run.step()
    rng = torch.get_rng_state()
    run.manager.save_checkpoint(
        os.path.join(args.dir, "ours", f"global_step_{SAVE_STEP}", "actor"), global_step=SAVE_STEP
    )
    finish_pending()
    torch.set_rng_state(rng)
    plain = FSDPCheckpointManager(
        run.model,
        run.optimizer,
        run.scheduler,
        processing_class=run.manager.processing_class,
        checkpoint_config=CheckpointConfig(),
    )
    plain.save_checkpoint(os.path.join(args.dir, "verl", f"global_step_{SAVE_STEP}", "actor"), global_step=SAVE_STEP)
    torch.set_rng_state(rng)
    dist.barrier()
    if dist.get_rank() == 0:
        for root in ("ours", "verl"):
            write_tracker(os.path.join(args.dir, root), SAVE_STEP)
    full = _full_state(run)
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(args.dir, "full_state.pt"))
    reference = [run.step() for _ in range(STEPS_AFTER)]
    write_result(args, "save", {"reference": reference})


def _resume_case(saved_dir: str, root: str, ignore_group_order: bool) -> dict:
    from verl.trainer.config import CheckpointConfig
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    step_dir = find_latest_ckpt_path(root)
    run = tiny_run.Run(seed=1, ckpt_config=CheckpointConfig())
    torch.manual_seed(1234 + dist.get_rank())  # a state the load must replace
    try:
        run.manager.load_checkpoint(os.path.join(step_dir, "actor"))
    except Exception as exc:  # noqa: BLE001 - a case may expect verl's own loader to fail
        dist.barrier()
        return {"step_dir": step_dir, "error": f"{type(exc).__name__}: {exc}"}
    saved = torch.load(os.path.join(saved_dir, "full_state.pt"), weights_only=False)
    loaded = _full_state(run)
    if ignore_group_order:  # a step of another FSDP version: its optimizer numbered its parameters otherwise
        for state in (saved, loaded):  # a full state dict with cpu_offload is empty beyond rank 0
            groups = state["optim"].get("param_groups", [])
            state["optim"] = {**state["optim"], "param_groups": [{**g, "params": sorted(g["params"])} for g in groups]}
    diffs = (
        tiny_run.tensors_equal(saved["model"], loaded["model"], "model")
        + tiny_run.tensors_equal(saved["optim"], loaded["optim"], "optim")
        + tiny_run.tensors_equal(saved["scheduler"], loaded["scheduler"], "scheduler")
    )
    losses = [run.step() for _ in range(STEPS_AFTER)]
    return {
        "step_dir": step_dir,
        "diffs": diffs[:20],
        "losses": losses,
        "n_model": len(saved["model"]),
        "slimckpt_patched": _patched(),
    }


def scenario_resume(args) -> None:
    """Each --case NAME:SAVED_DIR:ROOT in turn: unpatched verl resumes what the tracker of ROOT names
    and compares the state with SAVED_DIR/full_state.pt; one result file for all."""
    results = {}
    for case in args.case:
        name, saved_dir, root = case.split(":", 2)
        results[name] = _resume_case(saved_dir, root, args.ignore_group_order)
    write_result(args, f"resume_{args.name}", results)


def _patched() -> bool:
    """Whether any slimckpt patch is on verl's manager (SLIMCKPT_DISABLE=1 must leave none)."""
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    return any(
        "slimckpt" in (getattr(getattr(FSDPCheckpointManager, n), "__module__", "") or "")
        for n in ("save_checkpoint", "load_checkpoint")
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenario", choices=["save", "resume"])
    p.add_argument("--dir", required=True)
    p.add_argument(
        "--case",
        action="append",
        default=[],
        help="resume: NAME:SAVED_DIR:ROOT (ROOT: the checkpoint root, trainer.default_local_dir)",
    )
    p.add_argument(
        "--ignore-group-order",
        dest="ignore_group_order",
        action="store_true",
        help="resume: compare the optimizer's param_groups as sets of names",
    )
    p.add_argument("--name", default="", help="resume: a name for the result file")
    p.add_argument("--fsdp", type=int, choices=[1, 2], default=2)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    tiny_run.FSDP_VERSION = args.fsdp
    if args.fsdp == 1:  # verl's default FSDP1 wrapping: flat parameters (fsdp_config.use_orig_params=false)
        from slimckpt_testing.verl_checkpoints import fsdp_checkpoint

        fsdp_checkpoint.wrap_fsdp1 = functools.partial(fsdp_checkpoint.wrap_fsdp1, use_orig_params=False)
    globals()[f"scenario_{args.scenario}"](args)


# Leave without the interpreter's teardown: a save scenario's process, with every file and result
# written and the process group destroyed, sometimes aborts in it ("terminate called without an
# active exception", both ranks), which torchrun reports as a failed run.
HARD_EXIT = True
