"""Multi-process scenarios for the incremental tier, run by tests/save/test_resume_state.py and
`make faults` (scripts/faults/corruption.py) under torchrun
(gloo, CPU, FSDP2, a tiny Llama) through verl's real FSDPCheckpointManager:

    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.resume resume --dir D [--async]
    torchrun --nproc_per_node 1 -m slimckpt_testing.launch slimckpt_testing.scenarios.resume reshard --dir D     (after `resume` at 2)
    torchrun --nproc_per_node 3 -m slimckpt_testing.launch slimckpt_testing.scenarios.resume reshard --dir D --save-to D3  (D3: a step-3 save at 3)
    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.resume tracker --dir D
    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.resume refuse --dir D
    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.resume damaged_newest --dir D [--trials N --seed S]

Each writes D/<scenario>[_async]_result.json on rank 0; the test asserts on it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from slimckpt.storage import for_path

# lazy imports: verl, transformers and slimckpt's save path load inside a scenario, after it set the switches
# and module settings they read
VOCAB, STEPS_BEFORE, STEPS_AFTER, SAVE_STEP = 64, 3, 3, 3


MODEL = "llama"  # --model qwen2-tied: tied embeddings (lm_head.weight is embed_tokens.weight)
FSDP_VERSION = 2  # --fsdp 1: FullyShardedDataParallel (verl's strategy=fsdp)
PLACEMENT = "dim0"  # FSDP2: "divisible" shards each parameter on its first dim divisible by the world size
LORA_RANK = 0  # > 0: the model wrapped by peft (LoRA of this rank, alpha 2r, on q_proj/v_proj), as verl's actor


def tiny_args():
    # experts: routed experts of the mixture-of-experts families (3 over 2 ranks: uneven shards)
    return SimpleNamespace(
        model=MODEL, vocab=VOCAB, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, experts=3
    )


class Run:
    """Model, optimizer, scheduler and verl's checkpoint manager on this process group."""

    def __init__(self, seed: int, ckpt_config) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

        from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import (
            build_config,
            build_tokenizer,
            wrap_fsdp1,
            wrap_fsdp2,
        )

        torch.manual_seed(seed)
        world = dist.get_world_size()
        model = AutoModelForCausalLM.from_config(build_config(tiny_args()))
        if LORA_RANK:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model,
                LoraConfig(
                    r=LORA_RANK, lora_alpha=2 * LORA_RANK, task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"]
                ),
            )
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        self.model = wrap_fsdp2(model, mesh, PLACEMENT, world) if FSDP_VERSION == 2 else wrap_fsdp1(model, mesh)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / 4))
        self.manager = FSDPCheckpointManager(
            self.model,
            self.optimizer,
            self.scheduler,
            processing_class=build_tokenizer(VOCAB),
            checkpoint_config=ckpt_config,
        )

    def step(self) -> float:
        # data from the global RNG, so the RNG state in extra matters for an exact resume
        ids = torch.randint(0, VOCAB, (2, 12))
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def full_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "model": get_model_state_dict(self.model, options=opts),
            "optim": get_optimizer_state_dict(self.model, self.optimizer, options=opts),
            "scheduler": self.scheduler.state_dict(),
        }


def slim_config(**kw):
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    return SlimCheckpointConfig(recipe="incremental", incremental_save=True, measure=False, **kw)


def _tensors_equal(a, b, path="") -> list[str]:
    """Paths where two nested state dicts differ (bitwise for tensors)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))[:4]}"]
        return [d for k in a for d in _tensors_equal(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: len"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _tensors_equal(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def write_result(args, name: str, result: dict) -> None:
    if dist.get_rank() == 0:
        with open(os.path.join(args.dir, f"{name}_result.json"), "w") as f:
            json.dump(result, f, indent=1)


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
    if FSDP_VERSION == 1:
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
        _tensors_equal(saved["model"], loaded["model"], "model")
        + _tensors_equal(saved["optim"], loaded["optim"], "optim")
        + _tensors_equal(saved["scheduler"], loaded["scheduler"], "scheduler")
    )
    losses = [run.step() for _ in range(2)]
    save_to = getattr(args, "save_to", None)
    if save_to:
        run.manager.save_checkpoint(os.path.join(save_to, f"global_step_{SAVE_STEP}", "actor"), global_step=SAVE_STEP)
        full = run.full_state()  # collective
        if rank == 0:
            torch.save(full, os.path.join(save_to, "full_state_at_save.pt"))
    write_result(args, f"reshard_ws{world}", {"diffs": diffs[:20], "losses": losses, "n_model": len(saved["model"])})


def scenario_tracker(args) -> None:
    """A verl-like trainer whose actor saves asynchronously, each background write made slow:
    a watcher thread checks all along that the tracker never names a step without its manifest."""
    from omegaconf import OmegaConf

    from slimckpt.layout.resume_manifest import MANIFEST_NAME, read_tracker
    from slimckpt.save import step_write
    from slimckpt.save.driver.tracker import wrap_trainer_save_checkpoint
    from slimckpt.save.resume_state import finish_pending

    delay = 1.0
    real_after_shards = step_write._after_shards

    def slow_after_shards(*a, **k):  # the background write now takes >= delay seconds
        time.sleep(delay)
        return real_after_shards(*a, **k)

    step_write._after_shards = slow_after_shards
    root = args.dir
    run = Run(seed=0, ckpt_config=slim_config(async_save=True, host_memory_budget_gb=1.0))
    total = 3

    class FakeTrainer:
        """What verl's _save_checkpoint does with actor async_save=true: save, data.pt, no tracker."""

        config = OmegaConf.create(
            {
                "actor_rollout_ref": {
                    "actor": {
                        "checkpoint": {
                            "_target_": "slimckpt.verl.checkpoint_config.SlimCheckpointConfig",
                            "incremental_save": True,
                            "async_save": True,
                        }
                    }
                },
                "critic": {"checkpoint": {}},
                "trainer": {"default_local_dir": root},
            }
        )
        use_critic = False
        total_training_steps = total
        global_steps = 0

        def _save_checkpoint(self):
            step_dir = os.path.join(root, f"global_step_{self.global_steps}")
            run.manager.save_checkpoint(
                os.path.join(step_dir, "actor"), global_step=self.global_steps, max_ckpt_to_keep=1
            )
            if dist.get_rank() == 0:
                torch.save({"step": self.global_steps}, os.path.join(step_dir, "data.pt"))

    violations: list[str] = []
    seen: list[int] = []
    stop = threading.Event()

    def check() -> None:
        while not stop.is_set():
            step = read_tracker(root)
            if step is not None:
                if not seen or seen[-1] != step:
                    seen.append(step)
                if not os.path.exists(os.path.join(root, f"global_step_{step}", "actor", MANIFEST_NAME)):
                    violations.append(f"tracker names step {step} without a manifest")
            time.sleep(0.01)

    trainer = FakeTrainer()
    save = FakeTrainer._save_checkpoint
    if dist.get_rank() == 0:  # the driver: only it runs the tracker logic
        save = wrap_trainer_save_checkpoint(FakeTrainer._save_checkpoint)
        checker = threading.Thread(target=check, daemon=True)
        checker.start()
    right_after: list[int | None] = []
    blocking: list[float] = []
    for step in range(1, total + 1):
        run.step()
        trainer.global_steps = step
        t0 = time.perf_counter()
        save(trainer)
        blocking.append(time.perf_counter() - t0)
        right_after.append(read_tracker(root))
    finish_pending()
    dist.barrier()
    stop.set()
    kept = sorted(n for n in os.listdir(root) if n.startswith("global_step_"))
    actor_dirs = sorted(n for n in kept if os.path.isdir(os.path.join(root, n, "actor")))
    write_result(
        args,
        "tracker",
        {
            "violations": violations,
            "seen": seen,
            "tracker_right_after_save": right_after,
            "final": read_tracker(root),
            "blocking_s": blocking,
            "delay_s": delay,
            "actor_dirs": actor_dirs,
        },
    )


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


SLIM_TARGET = "slimckpt.verl.checkpoint_config.SlimCheckpointConfig"


class VerlTrainerShim:
    """What verl's PPOTrainer methods read of `self`, for this rank's manager: the trainer's config,
    the actor's worker group (this rank's load) and a stateful dataloader. `_save_checkpoint`
    does what verl's does with actor async_save=true: save, data.pt, no tracker write."""

    def __init__(self, root: str, run: Run, async_save: bool, mode: str = "auto", path: str | None = None) -> None:
        from omegaconf import OmegaConf

        self.root, self.run = root, run
        self.config = OmegaConf.create(
            {
                "actor_rollout_ref": {
                    "actor": {
                        "checkpoint": {"_target_": SLIM_TARGET, "incremental_save": True, "async_save": async_save}
                    }
                },
                "critic": {"checkpoint": {}},
                "trainer": {
                    "default_local_dir": root,
                    "default_hdfs_dir": None,
                    "resume_mode": mode,
                    "resume_from_path": path,
                    "del_local_ckpt_after_load": False,
                },
            }
        )
        self.use_critic = False
        self.trainer_mode = "sync"
        self.global_steps = 0
        self.total_training_steps = 10**6
        self.loaded_data: dict | None = None
        shim = self

        class Group:
            def load_checkpoint(self, local_path, del_local_after_load=False):
                run.manager.load_checkpoint(local_path)

        class Data:
            def load_state_dict(self, state):
                shim.loaded_data = state

        self.actor_rollout_wg, self.train_dataloader = Group(), Data()

    def _save_checkpoint(self) -> None:
        step_dir = os.path.join(self.root, f"global_step_{self.global_steps}")
        self.run.manager.save_checkpoint(os.path.join(step_dir, "actor"), global_step=self.global_steps)
        if dist.get_rank() == 0:
            torch.save({"step": self.global_steps}, os.path.join(step_dir, "data.pt"))


def _capture_log(name: str) -> list[str]:
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger(name).addHandler(Keep(logging.WARNING))
    return lines


def scenario_damaged_newest(args) -> None:
    """Steps 2 and 4 committed (async, the export on, the tracker moved by slimckpt's watcher);
    then per trial a copy of the checkpoint dir whose step 4 is damaged one way
    (slimckpt_testing.damage), and a fresh model resumed through verl's PPOTrainer._load_checkpoint
    (slimckpt's patch on it) with resume_mode=auto: it must go on from step 2 exactly (state, RNG
    and the next loss equal to a plain load of step 2), log one line naming the damaged file,
    move the tracker to 2 and leave step 4 on disk; resume_from_path to step 4 must refuse in one
    line. In the first trial the resumed run then saves step 3: the tracker moves to 3."""
    import copy
    import shutil

    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from slimckpt.layout.resume_manifest import UncommittedCheckpoint, read_tracker
    from slimckpt.save.driver.driver_state import driver_state_of
    from slimckpt.save.driver.tracker import wrap_trainer_save_checkpoint
    from slimckpt.save.resume_state import finish_pending
    from slimckpt_testing.damage import KINDS, damage_step

    rank = dist.get_rank()
    base = os.path.join(args.dir, "base")
    config = dict(async_save=True, host_memory_budget_gb=1.0, export_hf=True)
    run = Run(seed=0, ckpt_config=slim_config(**config))
    trainer = VerlTrainerShim(base, run, async_save=True)
    # the tracker is moved by slimckpt's watcher in the driver (rank 0 here), as in a verl run
    save = (
        wrap_trainer_save_checkpoint(VerlTrainerShim._save_checkpoint)
        if rank == 0
        else VerlTrainerShim._save_checkpoint
    )
    load = PPOTrainer._load_checkpoint  # verl's own, with slimckpt's patch (the registry applied it)
    assert getattr(load, "__wrapped__", None) is not None, "slimckpt's _load_checkpoint patch is not applied"
    for step in (1, 2, 3, 4):
        run.step()
        if step % 2 == 0:
            trainer.global_steps = step
            save(trainer)
    finish_pending()
    if rank == 0:
        driver_state_of(trainer).watcher.wait()
    dist.barrier()

    reference = Run(seed=1, ckpt_config=slim_config())
    reference.manager.load_checkpoint(os.path.join(base, "global_step_2", "actor"))
    ref_state = copy.deepcopy(reference.full_state())  # the optimizer's step counts are live tensors
    ref_loss = reference.step()
    del reference

    trials = int(getattr(args, "trials", 0) or len(KINDS))
    rng = random.Random(int(getattr(args, "seed", 0) or 0))
    # every rank runs the trainer's _load_checkpoint here (verl: the driver alone), so whichever
    # rank reaches the damaged tracker first says it; all must agree on the one line
    lines = _capture_log("slimckpt.resume")
    out: list[dict] = []
    for i in range(trials):
        kind = KINDS[i % len(KINDS)]
        root = os.path.join(args.dir, f"trial_{i:03d}_{kind}")
        what = [None]
        if rank == 0:
            shutil.copytree(base, root)
            what[0] = damage_step(os.path.join(root, "global_step_4", "actor"), kind, rng)
        dist.broadcast_object_list(what, src=0)
        dist.barrier()
        before = len(lines)
        torch.manual_seed(4321 + i)  # an RNG state the load must replace
        fresh = Run(seed=2 + i, ckpt_config=slim_config(**config))
        resumed = VerlTrainerShim(root, fresh, async_save=True)
        error = None
        try:
            load(resumed)
        except Exception as exc:  # noqa: BLE001 - the outcome is recorded
            error = f"{type(exc).__name__}: {exc}"
        said: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(said, lines[before:])
        diffs = _tensors_equal(ref_state, fresh.full_state()) if error is None else ["not loaded"]
        loss = fresh.step() if error is None else None
        refused = None
        try:
            load(
                VerlTrainerShim(
                    root, fresh, async_save=True, mode="resume_path", path=os.path.join(root, "global_step_4")
                )
            )
        except UncommittedCheckpoint as exc:
            refused = str(exc)
        dist.barrier()
        result = {
            "kind": kind,
            "damage": what[0],
            "error": error,
            "global_steps": resumed.global_steps,
            "data": resumed.loaded_data,
            "diffs": diffs[:8],
            "loss_equal": loss == ref_loss,
            "tracker": read_tracker(root),
            "step4_kept": os.path.isdir(os.path.join(root, "global_step_4", "actor")),
            "lines": sorted({line for part in said for line in part}),
            "refused": refused,
        }
        if i == 0:  # the resumed run saves step 3, below the damaged 4: the tracker follows
            resumed.global_steps = 3
            save(resumed)
            finish_pending()
            if rank == 0:
                driver_state_of(resumed).watcher.wait()
            dist.barrier()
            result["tracker_after_saving_3"] = read_tracker(root)
        out.append(result)
        del fresh
        if rank == 0 and not getattr(args, "keep", False):
            for_path(root).remove_tree(root, ignore_errors=True)
    write_result(args, "damaged_newest", {"trials": out, "reference_loss": ref_loss})


def scenario_lora_only(args) -> None:
    """verl's save_lora_only in the incremental tier: a LoRA actor (r=4 on q_proj/v_proj) trained 2 steps is
    saved whole and LoRA-only (async, with the export) at the same step; a fresh model built as at the
    run's start (the base of model.path) loads the LoRA-only step, another (other seed) the whole one:
    both must hold the same model and optimizer state and train the same losses as the run itself.
    Also: what the LoRA-only step holds, its export, `slimckpt verify`, retention, and
    export_merge_lora's refusal; +recipe=intermediate's export of verl's LoRA-only save (the adapter
    alone; export_merge_lora refused). D/lora_only_result.json on rank 0."""
    from slimckpt.save.resume_state import finish_pending

    global LORA_RANK
    LORA_RANK = 4
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
        out["state_differs"] = _tensors_equal(state_full, state_lora)
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
    p.add_argument("scenario", choices=["resume", "reshard", "tracker", "refuse", "damaged_newest"])
    p.add_argument("--dir", required=True)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--save-to", dest="save_to", help="reshard: then save step 3 at this world size here")
    p.add_argument("--model", choices=["llama", "qwen2-tied"], default="llama")
    p.add_argument("--fsdp", type=int, choices=[1, 2], default=2)
    p.add_argument("--trials", type=int, default=0, help="damaged_newest: restarts (default one per damage kind)")
    p.add_argument("--seed", type=int, default=0, help="damaged_newest: where the damage falls")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    global MODEL, FSDP_VERSION
    MODEL, FSDP_VERSION = args.model, args.fsdp
    globals()[f"scenario_{args.scenario}"](args)
