"""Multi-process scenarios for the incremental tier, run by tests/save/test_resume_state.py and
`make faults` (scripts/faults/corruption.py) under torchrun
(gloo, CPU, FSDP2, a tiny Llama: slimckpt_testing.scenarios.tiny_run) through verl's real FSDPCheckpointManager:

    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.resume resume --dir D [--async]
    torchrun --nproc_per_node 1 -m slimckpt_testing.launch slimckpt_testing.scenarios.resume reshard --dir D     (after `resume` at 2)
    torchrun --nproc_per_node 3 -m slimckpt_testing.launch slimckpt_testing.scenarios.resume reshard --dir D --save-to D3  (D3: a step-3 save at 3)
    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.resume refuse --dir D

Each writes D/<scenario>[_async]_result.json on rank 0; the test asserts on it. The trainer's side (the
tracker, a damaged newest step under resume_mode=auto) is slimckpt_testing.scenarios.driver.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from slimckpt_testing.scenarios import tiny_run
from slimckpt_testing.scenarios.tiny_run import (
    SAVE_STEP,
    STEPS_AFTER,
    STEPS_BEFORE,
    Run,
    slim_config,
    tensors_equal,
    write_result,
)

# lazy imports: verl, transformers and slimckpt's save path load inside a scenario, after it set the switches
# and module settings they read


def scenario_resume(args) -> None:
    """Train, save at step 3 (sync or async), keep training; then a fresh model loads step 3 and
    trains the same steps: losses must be bitwise equal. Also: verl's own format still loads."""
    from slimckpt.save.resume_state import finish_pending

    config = slim_config(async_save=args.async_save, host_memory_budget_gb=1.0)
    path = os.path.join(args.dir, f"global_step_{SAVE_STEP}", "actor")
    if args.async_save:
        # hold the background write back until training has changed every parameter in place:
        # only a real staged copy still holds the step-3 values then
        from slimckpt.save import step_write

        real_writer = step_write.storage_writer

        def late_writer(*a, **k):
            time.sleep(1.5)
            return real_writer(*a, **k)

        step_write.storage_writer = late_writer
    run = Run(seed=0, ckpt_config=config)
    for _ in range(STEPS_BEFORE):
        run.step()
    t0 = time.perf_counter()
    run.manager.save_checkpoint(path, global_step=SAVE_STEP, max_ckpt_to_keep=2)
    blocking = time.perf_counter() - t0
    if tiny_run.FSDP_VERSION == 1:
        pass  # FSDP1's full state dict with cpu_offload crashes on CPU/gloo; the reshard check is FSDP2's
    elif dist.get_rank() == 0:
        torch.save(run.full_state(), os.path.join(args.dir, "full_state_at_save.pt"))
    else:
        run.full_state()  # collective
    reference = [run.step() for _ in range(STEPS_AFTER)]  # with async, the write runs meanwhile
    committed_during_training = os.path.exists(os.path.join(path, "slimckpt_resume.json"))
    finish_pending()
    dist.barrier()
    over_budget_committed = None
    if args.async_save:  # a budget too small for the state: the save streams synchronously
        run.manager.checkpoint_config = slim_config(async_save=True, host_memory_budget_gb=0.0)
        over = os.path.join(args.dir, "global_step_9", "actor")
        run.manager.save_checkpoint(over, global_step=9)
        over_budget_committed = os.path.exists(os.path.join(over, "slimckpt_resume.json"))

    torch.manual_seed(1234)  # a different RNG state: the load must restore the saved one
    resumed = Run(seed=1, ckpt_config=slim_config())
    resumed.manager.load_checkpoint(path)
    after = [resumed.step() for _ in range(STEPS_AFTER)]

    # verl's own format through the same patched manager
    from verl.trainer.config import CheckpointConfig

    verl_path = os.path.join(args.dir, "verl_format", "actor")
    plain = Run(seed=0, ckpt_config=CheckpointConfig())
    plain.step()
    plain.manager.save_checkpoint(verl_path, global_step=1)
    plain_ref = [plain.step() for _ in range(2)]
    plain2 = Run(seed=1, ckpt_config=CheckpointConfig())
    plain2.manager.load_checkpoint(verl_path)
    plain_after = [plain2.step() for _ in range(2)]

    files = sorted(os.listdir(path))
    with open(os.path.join(path, "slimckpt_resume.json")) as f:
        aliases = json.load(f)["extra"]["aliases"]
    write_result(
        args,
        "resume_async" if args.async_save else "resume",
        {
            "reference": reference,
            "resumed": after,
            "blocking_s": blocking,
            "files": files,
            "committed_during_training": committed_during_training,
            "aliases": aliases,
            "over_budget_committed_on_return": over_budget_committed,
            "dcp_files": sorted(os.listdir(os.path.join(path, "dcp"))),
            "verl_format_files": sorted(os.listdir(verl_path)),
            "verl_reference": plain_ref,
            "verl_resumed": plain_after,
        },
    )


def scenario_reshard(args) -> None:
    """Load the step-3 state under args.dir at this world size; compare with the full state dumped
    at save time; train two more steps. Each rank dumps its RNG state right after the load, twice:
    a second load, after other draws, must give the same state. With --save-to, then save step 3
    at this world size there (and its full state), for a reshard from this world size."""
    path = os.path.join(args.dir, f"global_step_{SAVE_STEP}", "actor")
    rank, world = dist.get_rank(), dist.get_world_size()
    run = Run(seed=7, ckpt_config=slim_config())
    after_load = []
    for attempt in range(2):
        seed = 1000 + 10 * attempt + rank  # a state the load must replace, different each time
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        run.manager.load_checkpoint(path)
        after_load.append(run.manager.get_rng_state())
    torch.save(after_load, os.path.join(args.dir, f"rng_after_load_ws{world}_rank{rank}.pt"))
    saved = torch.load(os.path.join(args.dir, "full_state_at_save.pt"), weights_only=False)
    loaded = run.full_state()
    diffs = (
        tensors_equal(saved["model"], loaded["model"], "model")
        + tensors_equal(saved["optim"], loaded["optim"], "optim")
        + tensors_equal(saved["scheduler"], loaded["scheduler"], "scheduler")
    )
    losses = [run.step() for _ in range(2)]
    save_to = getattr(args, "save_to", None)
    if save_to:
        run.manager.save_checkpoint(os.path.join(save_to, f"global_step_{SAVE_STEP}", "actor"), global_step=SAVE_STEP)
        full = run.full_state()  # collective
        if rank == 0:
            torch.save(full, os.path.join(save_to, "full_state_at_save.pt"))
    write_result(args, f"reshard_ws{world}", {"diffs": diffs[:20], "losses": losses, "n_model": len(saved["model"])})


def scenario_refuse(args) -> None:
    """A save that dies before its commit leaves a directory that every load refuses."""
    from slimckpt.layout.resume_manifest import UncommittedCheckpoint
    from slimckpt.save import step_commit

    outcomes: dict[str, str] = {}
    run = Run(seed=0, ckpt_config=slim_config())
    run.step()

    # 1. the process "dies" between the shard write and the manifest
    real_commit = step_commit.commit

    def crash(*a, **k):
        raise KeyboardInterrupt("simulated crash before the manifest")

    step_commit.commit = crash
    half = os.path.join(args.dir, "global_step_1", "actor")
    try:
        run.manager.save_checkpoint(half, global_step=1)
    except KeyboardInterrupt:
        outcomes["save"] = "crashed"
    step_commit.commit = real_commit
    dist.barrier()
    outcomes["half_files"] = ",".join(sorted(os.listdir(half)))
    fresh = Run(seed=1, ckpt_config=slim_config())
    try:
        fresh.manager.load_checkpoint(half)
        outcomes["half"] = "LOADED"
    except UncommittedCheckpoint as exc:
        outcomes["half"] = str(exc)

    # 2. a committed step whose shard was truncated afterwards
    good = os.path.join(args.dir, "global_step_2", "actor")
    run.manager.save_checkpoint(good, global_step=2)
    dist.barrier()
    if dist.get_rank() == 0:
        victim = os.path.join(good, "dcp", "__1_0.distcp")
        os.truncate(victim, os.path.getsize(victim) // 2)
    dist.barrier()
    try:
        fresh.manager.load_checkpoint(good)
        outcomes["truncated"] = "LOADED"
    except UncommittedCheckpoint as exc:
        outcomes["truncated"] = str(exc)
    write_result(args, "refuse", outcomes)


def scenario_lora_only(args) -> None:
    """verl's save_lora_only in the incremental tier: a LoRA actor (r=4 on q_proj/v_proj) trained 2 steps is
    saved whole and LoRA-only (async, with the export) at the same step; a fresh model built as at the
    run's start (the base of model.path) loads the LoRA-only step, another (other seed) the whole one:
    both must hold the same model and optimizer state and train the same losses as the run itself.
    Also: what the LoRA-only step holds, its export, `slimckpt verify`, retention, and
    export_merge_lora's refusal; +recipe=intermediate's export of verl's LoRA-only save (the adapter
    alone; export_merge_lora refused). D/lora_only_result.json on rank 0."""
    from slimckpt.save.resume_state import finish_pending

    tiny_run.LORA_RANK = 4
    root = args.dir
    full = os.path.join(root, "full", "global_step_2", "actor")
    lora_root = os.path.join(root, "lora_only")
    lora = os.path.join(lora_root, "global_step_2", "actor")
    run = Run(seed=0, ckpt_config=slim_config())
    for _ in range(2):
        run.step()
    run.manager.checkpoint_config = slim_config(export_hf=True, export_dtype="bf16")
    run.manager.save_checkpoint(full, global_step=2)
    run.manager.checkpoint_config = slim_config(
        save_lora_only=True, export_hf=True, export_dtype="bf16", async_save=True, host_memory_budget_gb=1.0
    )
    run.manager.save_checkpoint(lora, global_step=2)
    finish_pending()
    # +recipe=intermediate with save_lora_only: verl's LoRA-only .pt shards, exported as lora_adapter/ alone
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    run.manager.checkpoint_save_contents = ["model"]
    for merge_lora in (False, True):
        run.manager.checkpoint_config = SlimCheckpointConfig(
            recipe="intermediate",
            save_contents=["model"],
            load_contents=["model"],
            export_hf=True,
            export_dtype="bf16",
            measure=False,
            save_lora_only=True,
            export_merge_lora=merge_lora,
        )
        try:
            run.manager.save_checkpoint(
                os.path.join(root, f"intermediate_{merge_lora}", "global_step_2", "actor"), global_step=2
            )
        except Exception as exc:  # noqa: BLE001 - the line is the result
            refused_intermediate = str(exc)
    run.manager.checkpoint_save_contents = ["model", "optimizer", "extra"]
    refused = None
    run.manager.checkpoint_config = slim_config(save_lora_only=True, export_hf=True, export_merge_lora=True)
    try:
        run.manager.save_checkpoint(os.path.join(root, "merged", "global_step_2", "actor"), global_step=2)
    except Exception as exc:  # noqa: BLE001 - the line is the result
        refused = str(exc)
    reference = [run.step() for _ in range(2)]

    # one after the other: the data come from the process's global RNG, which each load restores
    from_full = Run(seed=1, ckpt_config=slim_config())
    from_full.manager.load_checkpoint(full)
    state_full = from_full.full_state()
    after_full = [from_full.step() for _ in range(2)]
    from_lora = Run(seed=0, ckpt_config=slim_config())  # the base weights of model.path: as the run started
    from_lora.manager.load_checkpoint(lora)
    state_lora = from_lora.full_state()
    after_lora = [from_lora.step() for _ in range(2)]

    out = {
        "reference": reference,
        "after_full": after_full,
        "after_lora": after_lora,
        "refused": refused,
        "refused_intermediate": refused_intermediate,
    }
    if dist.get_rank() == 0:
        out["state_differs"] = tensors_equal(state_full, state_lora)
        out.update(_lora_only_step(root, full, lora))
    dist.barrier()
    # retention over LoRA-only steps: keep 1, so step 2 goes once step 4 is committed
    run.manager.checkpoint_config = slim_config(save_lora_only=True)
    run.manager.save_checkpoint(os.path.join(lora_root, "global_step_4", "actor"), global_step=4, max_ckpt_to_keep=1)
    finish_pending()
    dist.barrier()
    out["steps_kept"] = sorted(n for n in os.listdir(lora_root) if os.path.isdir(os.path.join(lora_root, n, "actor")))
    write_result(args, "lora_only", out)


def _lora_only_step(root: str, full: str, lora: str) -> dict:
    """What the LoRA-only step holds, next to the whole one; `slimckpt verify` of it."""
    import hashlib

    from torch.distributed.checkpoint import FileSystemReader

    from slimckpt.verify.command import verify_path

    def manifest(path):
        with open(os.path.join(path, "slimckpt_resume.json")) as f:
            return json.load(f)

    def digest(path):
        return hashlib.sha256(open(path, "rb").read()).hexdigest()

    keys = sorted(FileSystemReader(os.path.join(lora, "dcp")).read_metadata().state_dict_metadata)
    hf = os.path.join(lora, "huggingface")
    adapter = os.path.join("lora_adapter", "adapter_model.safetensors")
    ihf = os.path.join(root, "intermediate_False", "global_step_2", "actor", "huggingface")
    return {
        "manifest_extra": {k: v for k, v in manifest(lora)["extra"].items() if k != "timings_s"},
        "bytes": {"full": manifest(full)["extra"]["bytes"], "lora_only": manifest(lora)["extra"]["bytes"]},
        "model_keys": [k for k in keys if k.startswith("model.")],
        "optim_state_keys": sorted(
            {k.split(".", 2)[2].rsplit(".", 1)[0] for k in keys if k.startswith("optim.state.")}
        ),
        "export_files": sorted(os.path.relpath(os.path.join(r, n), hf) for r, _, ns in os.walk(hf) for n in ns),
        "adapter_same_as_full_export": digest(os.path.join(hf, adapter))
        == digest(os.path.join(full, "huggingface", adapter)),
        "adapter_config_same": open(os.path.join(hf, "lora_adapter", "adapter_config.json")).read()
        == open(os.path.join(full, "huggingface", "lora_adapter", "adapter_config.json")).read(),
        "verify_ok": verify_path(lora).ok,
        "intermediate_export_files": sorted(
            os.path.relpath(os.path.join(r, n), ihf) for r, _, ns in os.walk(ihf) for n in ns
        ),
        "intermediate_adapter_same": digest(os.path.join(ihf, adapter)) == digest(os.path.join(hf, adapter)),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenario", choices=["resume", "reshard", "refuse"])
    p.add_argument("--dir", required=True)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--save-to", dest="save_to", help="reshard: then save step 3 at this world size here")
    p.add_argument("--model", choices=["llama", "qwen2-tied"], default="llama")
    p.add_argument("--fsdp", type=int, choices=[1, 2], default=2)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    tiny_run.MODEL, tiny_run.FSDP_VERSION = args.model, args.fsdp
    globals()[f"scenario_{args.scenario}"](args)
