"""Multi-process scenarios of the trainer's side of the incremental tier, run by tests/save/test_resume_state.py
and `make faults` (scripts/faults/corruption.py) under torchrun (gloo, CPU, FSDP2, a tiny Llama:
slimckpt_testing.scenarios.tiny_run) through verl's real FSDPCheckpointManager and a stand-in for verl's
PPOTrainer (`VerlTrainerShim`): the tracker under async saves, and resume_mode=auto past a damaged newest step.

    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.driver tracker --dir D
    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.driver damaged_newest --dir D [--trials N --seed S]

Each writes D/<scenario>_result.json on rank 0; the test asserts on it.
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from slimckpt.storage import for_path
from slimckpt_testing.scenarios import tiny_run
from slimckpt_testing.scenarios.tiny_run import Run, slim_config, tensors_equal, write_result

# lazy imports: verl, transformers and slimckpt's save path load inside a scenario, after it set the switches
# and module settings they read


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
        diffs = tensors_equal(ref_state, fresh.full_state()) if error is None else ["not loaded"]
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenario", choices=["tracker", "damaged_newest"])
    p.add_argument("--dir", required=True)
    p.add_argument("--model", choices=["llama", "qwen2-tied"], default="llama")
    p.add_argument("--fsdp", type=int, choices=[1, 2], default=2)
    p.add_argument("--trials", type=int, default=0, help="damaged_newest: restarts (default one per damage kind)")
    p.add_argument("--seed", type=int, default=0, help="damaged_newest: where the damage falls")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    tiny_run.MODEL, tiny_run.FSDP_VERSION = args.model, args.fsdp
    globals()[f"scenario_{args.scenario}"](args)
