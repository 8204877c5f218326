"""Children of the SIGKILL campaign (scripts/faults/reliability.py), forked from a parent that imported
torch, transformers and verl once. Nothing here re-implements verl's checkpoint decisions:

- the trainer's side is verl's own `PPOTrainer._save_checkpoint` / `_load_checkpoint` (the v1
  trainer, verl 0.9.1's default) called on a stand-in `self` holding the config keys they read;
  slimckpt's tracker patch wraps `_save_checkpoint` exactly as in a run;
- `actor_rollout_wg` and `critic_wg` (PPO: `use_critic`) forward each call to every rank (rank 0
  broadcasts it, all ranks run it, the call returns once all ranks are done, like Ray's
  worker-group call) and each rank runs verl's real FSDPCheckpointManager on a tiny FSDP2 Llama
  (the actor) and a tiny FSDP2 value model (verl's critic class) over gloo, patched by slimckpt
  when the mode's checkpoint block is a recipe's SlimCheckpointConfig and untouched otherwise;
- each role's `checkpoint:` block is the recipe file's as shipped (the actor's export included);
- the merge child execs `slimckpt merge` as a fresh command, or runs verl's FSDPModelMerger.

Rank 0 is the driver and worker 0 at once; a kill takes all ranks within microseconds, as a node
failure or a scheduler's SIGKILL does. World size 2, so per-rank files, the commit's gather and
the DCP plan run as they do on a cluster.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from scripts.faults.trial_model import ROLES, WORLD, Run, content_key, state_hashes

# lazy imports: torch, verl and slimckpt load in the forked children, after the campaign's quiet_imports()

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES_DIR = os.path.join(REPO, "recipes")  # reliability.py --source points it at a snapshot's recipes/
MAX_STEPS = 400

# mode -> (recipe file or None for verl's own default block, overrides of the checkpoint block)
MODES: dict[str, tuple[str | None, dict[str, Any]]] = {
    "verl-default": (None, {}),
    "quickstart": ("quickstart", {}),
    "incremental-sync": ("incremental", {"async_save": False}),
    "incremental-async": ("incremental", {"async_save": True}),
    # not in reliability.py's SAVE_MODES (make faults): scripts/faults/keep1.py runs it
    "incremental-stream": ("incremental", {"async_save": "stream"}),
}
MERGE_MODES = ("merge", "verl-merge")


# --------------------------------------------------------------------------- config


def checkpoint_block(mode: str, role: str = "actor") -> dict[str, Any]:
    """A role's `checkpoint:` block as a run of this mode gets it: verl's generated default, or
    the recipe file's block as shipped (plus the mode's overrides)."""
    recipe, overrides = MODES[mode]
    if recipe is None:
        import verl
        from omegaconf import OmegaConf

        path = os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "_generated_ppo_trainer.yaml")
        cfg = OmegaConf.load(path)
        node = cfg.actor_rollout_ref.actor.checkpoint if role == "actor" else cfg.critic.checkpoint
        block = OmegaConf.to_container(node, resolve=True)
    else:
        from slimckpt.verl.recipes import recipe_checkpoint_block

        block = recipe_checkpoint_block(recipe, role, RECIPES_DIR)
    block.update(overrides)
    return block


def trainer_config(mode: str, root: str, keep: int | None):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "actor_rollout_ref": {"actor": {"checkpoint": checkpoint_block(mode)}},
            "critic": {"checkpoint": checkpoint_block(mode, "critic")},
            "trainer": {
                "default_local_dir": root,
                "default_hdfs_dir": None,
                "resume_mode": "auto",
                "resume_from_path": None,
                "del_local_ckpt_after_load": False,
                "remove_previous_ckpt_in_save": False,
                "max_actor_ckpt_to_keep": keep,
                "max_critic_ckpt_to_keep": keep,
            },
        }
    )


# --------------------------------------------------------------------------- events


class Events:
    """Append-only event log of one rank (os.write: a SIGKILL loses nothing already written)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, kind: str, step: int = -1, detail: str = "", sync: bool = False) -> None:
        os.write(self.fd, f"{time.monotonic():.6f} {kind} {step} {detail}\n".encode())
        if sync:
            os.fsync(self.fd)


_EVENTS: Events | None = None
_STEP = [0]


def _mark(kind: str) -> None:
    if _EVENTS is not None:
        _EVENTS(kind, _STEP[0])


def _wrap(owner: Any, name: str, kind=None, after=None) -> None:
    """Write a phase marker before `owner.name` runs (`kind`) and once it has returned (`after`,
    given its result; a marker, or None for none); behaviour unchanged."""
    original = getattr(owner, name)

    def wrapper(*a, **k):
        if kind is not None:
            _mark(kind(a, k) if callable(kind) else kind)
        result = original(*a, **k)
        if after is not None:
            marker = after(a, result) if callable(after) else after
            if marker is not None:
                _mark(marker)
        return result

    wrapper.__wrapped__ = original
    setattr(owner, name, wrapper)


def _file_kind(a, k) -> str:
    target = a[1] if len(a) > 1 else k.get("f")
    name = os.path.basename(str(target)) if isinstance(target, (str, os.PathLike)) else "file"
    for prefix in ("model_", "optim_", "extra_state_", "slimckpt_extra_", "data.pt"):
        if name.startswith(prefix):
            return f"write:{prefix.rstrip('_')}"
    return "write:other"


def install_phase_markers() -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import PretrainedConfig
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    _wrap(torch, "save", _file_kind)
    _wrap(dcp, "save", "dcp-write")
    _wrap(PretrainedConfig, "save_pretrained", "hf-config")
    _wrap(BaseCheckpointManager, "remove_previous_save_local_path", "retention")


def install_slim_markers() -> None:
    """After slimckpt's patches are on: its commit and its async tracker write."""
    import slimckpt.save.driver.tracker as resume_tracker
    from slimckpt.save import step_commit

    _wrap(step_commit, "write_manifest", "manifest")
    # on every rank, once the step's commit outcome is known to it (after the save call, for an
    # async write): until then the rank is inside the save's collectives
    _wrap(step_commit, "commit", after="commit-done")
    _wrap(resume_tracker, "write_tracker", "tracker", after=_tracker_moved)


def _tracker_moved(args: tuple, moved: bool) -> None:
    """`write_tracker(root, step)` returned: log the step as committed if the tracker moved to it."""
    if moved and _EVENTS is not None:
        _EVENTS("committed", int(args[1]))


def compared_contents(mode: str) -> list[str]:
    """The hash keys a resume of this mode restores: each role's load_contents."""
    names = {"model": "model", "optimizer": "optim", "extra": "extra"}
    return [
        content_key(role, names[c])
        for role in ROLES
        for c in checkpoint_block(mode, role).get("load_contents") or []
        if c in names
    ]


# --------------------------------------------------------------------------- worker group


class WorkerGroup:
    """verl's actor_rollout_wg / critic_wg as the trainer sees it: a call runs on every rank and
    returns when all are done (an error on any rank is raised on the driver)."""

    def __init__(self, run: Run, role: str) -> None:
        self.run, self.role = run, role

    def _call(self, op: str, *args) -> None:
        dispatch(self.run, [op, [self.role, *args]])

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        self._call("save", local_path, hdfs_path, global_step, max_ckpt_to_keep)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        self._call("load", local_path, hdfs_path, del_local_after_load)


def execute(run: Run, op: str, args: list) -> None:
    if op == "save":
        # every rank marks its own save call: whether a survivor was inside a save when a peer was lost
        _mark("save-call")
        run.roles[args[0]].manager.save_checkpoint(args[1], args[2], args[3], max_ckpt_to_keep=args[4])
        _mark("save-call-done")
    elif op == "load":
        run.roles[args[0]].manager.load_checkpoint(args[1], args[2], del_local_after_load=args[3])
    elif op == "train":
        run.step()
        _EVENTS("hash", int(args[0]), json.dumps(state_hashes(run)), sync=True)
    elif op == "hash":
        import torch.distributed as dist

        with open(args[0].format(rank=dist.get_rank()), "w") as f:
            json.dump(state_hashes(run), f)


def dispatch(run: Run, message: list) -> None:
    """Rank 0: send `message` to every rank, run it, wait for all."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0)
    _run_and_gather(run, message)


def _run_and_gather(run: Run, message: list) -> None:
    import torch.distributed as dist

    error = None
    try:
        execute(run, message[0], message[1])
    except Exception as exc:  # noqa: BLE001 - reported to the driver, as Ray does
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first and dist.get_rank() == 0:
        raise RuntimeError(first)


def follow(run: Run) -> None:
    """Ranks > 0: run what rank 0 sends until it says stop."""
    import torch.distributed as dist

    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0][0] == "exit":
            return
        _run_and_gather(run, box[0])


def stop_followers() -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([["exit", []]], src=0)


class Loader:
    """The trainer's dataloader: its state is the step it stopped at."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.loaded = None

    def state_dict(self) -> dict:
        return {"step": int(self.trainer.global_steps)}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


class Callback:
    def on_save(self, **_: Any) -> None:
        pass


def make_trainer(mode: str, root: str, keep: int | None, run: Run, total: int):
    trainer = SimpleNamespace(
        config=trainer_config(mode, root, keep),
        global_steps=0,
        use_critic=True,
        trainer_mode="sync",
        total_training_steps=total,
        checkpoint_callback=Callback(),
        actor_rollout_wg=WorkerGroup(run, "actor"),
        critic_wg=WorkerGroup(run, "critic"),
    )
    trainer.train_dataloader = Loader(trainer)
    return trainer


# --------------------------------------------------------------------------- child bodies


def _init(trial_dir: str, rank: int, tag: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(trial_dir, f"store_{tag}"), WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=30))


def build_checkpoint_configs(mode: str) -> dict[str, Any]:
    """Each role's config as verl builds it from the block; a recipe's builds SlimCheckpointConfig,
    which switches slimckpt's checkpoint patches on in this process."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    return {role: omega_conf_to_dataclass(OmegaConf.create(checkpoint_block(mode, role))) for role in ROLES}


def assert_patching(mode: str) -> None:
    from verl.trainer.ppo.v1 import trainer_base
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    patched = (
        hasattr(FSDPCheckpointManager.save_checkpoint, "__wrapped__")
        and hasattr(trainer_base.PPOTrainer._save_checkpoint, "__wrapped__")
        and "open" in vars(trainer_base)  # the trainer's tracker write, made atomic
    )
    want = MODES[mode][0] is not None
    if patched != want:
        raise RuntimeError(f"{mode}: slimckpt's checkpoint patches {'missing' if want else 'applied'}")


def saver(mode: str, trial_dir: str, rank: int, keep: int | None, steps: int) -> None:
    """Train a step, record the state's hash, save through verl's trainer code; repeat."""
    global _EVENTS
    import torch.distributed as dist
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    _init(trial_dir, rank, "save")
    _EVENTS = Events(os.path.join(trial_dir, f"events_rank_{rank}.log"))
    configs = build_checkpoint_configs(mode)
    assert_patching(mode)
    install_phase_markers()
    if MODES[mode][0] is not None:
        install_slim_markers()
    run = Run(seed=0, configs=configs)
    root = os.path.join(trial_dir, "ckpt")
    dist.barrier()
    _EVENTS("ready", 0)
    if rank != 0:
        follow(run)
    else:
        trainer = make_trainer(mode, root, keep, run, total=steps)
        sync = not checkpoint_block(mode).get("async_save")  # read once: it loads a YAML file
        for step in range(1, steps + 1):
            _STEP[0] = step
            _EVENTS("train", step)
            dispatch(run, ["train", [step]])
            trainer.global_steps = step
            _EVENTS("save-begin", step)
            PPOTrainer._save_checkpoint(trainer)
            _EVENTS("save-returned", step)
            if sync:
                _EVENTS("committed", step)
        stop_followers()
    from slimckpt.save.resume_state import finish_pending

    finish_pending()
    dist.barrier()
    _EVENTS("done", steps)


def checker(mode: str, trial_dir: str, rank: int, keep: int | None) -> None:
    """A fresh process (different seed, so a missed load shows) resumes with resume_mode=auto
    through verl's `_load_checkpoint`; every rank writes the hash of the state it then holds."""
    import torch.distributed as dist
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    _init(trial_dir, rank, "check")
    run = Run(seed=1234, configs=build_checkpoint_configs(mode))
    out = os.path.join(trial_dir, "resume_result.json")
    if rank != 0:
        follow(run)
    else:
        trainer = make_trainer(mode, os.path.join(trial_dir, "ckpt"), keep, run, total=MAX_STEPS)
        error = None
        try:
            PPOTrainer._load_checkpoint(trainer)
        except Exception as exc:  # noqa: BLE001 - the outcome we classify
            text = str(exc).strip().splitlines()
            error = f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
        dispatch(run, ["hash", [os.path.join(trial_dir, "resume_hash_rank_{rank}.json")]])
        stop_followers()
        with open(out, "w") as f:
            json.dump(
                {"step": int(trainer.global_steps), "error": error, "dataloader": trainer.train_dataloader.loaded}, f
            )
    dist.barrier()


def build_merge_fixture(out_dir: str, rank: int, hidden: int, layers: int, vocab: int) -> None:
    """A verl FSDP checkpoint (world size 2, verl's own save) for the merge trials."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    from verl.trainer.config import CheckpointConfig
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import build_config, build_tokenizer, wrap_fsdp2

    _init(os.path.dirname(out_dir), rank, "fixture")
    torch.manual_seed(0)
    args = SimpleNamespace(
        model="llama", vocab=vocab, hidden=hidden, intermediate=hidden * 2, layers=layers, heads=4, kv_heads=2
    )
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    model = wrap_fsdp2(AutoModelForCausalLM.from_config(build_config(args)), mesh, "dim0", WORLD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = FSDPCheckpointManager(
        model,
        optimizer,
        None,
        processing_class=build_tokenizer(vocab),
        checkpoint_config=CheckpointConfig(save_contents=["model"], load_contents=["model"]),
    )
    manager.save_checkpoint(out_dir, global_step=1)
    dist.barrier()


def merge_child(kind: str, local_dir: str, target: str, overwrite: bool) -> int:
    """`slimckpt merge` as a fresh command, or verl's own FSDPModelMerger in this process.

    slimckpt's merge is exec'd, not run here: a fresh interpreter, as the command a user runs (with
    its imports' time, which this process has done already). The exec keeps this pid, so
    the campaign kills and waits for it as before."""
    if kind == "merge":
        import slimckpt

        argv = [
            sys.executable,
            "-m",
            "slimckpt.cli",
            "merge",
            "--local_dir",
            local_dir,
            "--target_dir",
            target,
            "--no_progress",
        ] + (["--overwrite"] if overwrite else [])
        source = os.path.dirname(os.path.dirname(os.path.abspath(slimckpt.__file__)))  # the code under test
        path = os.pathsep.join([source, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, argv, {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"})
    import torch

    torch.set_num_threads(1)
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    config = ModelMergerConfig(
        operation="merge",
        backend="fsdp",
        local_dir=local_dir,
        target_dir=target,
        hf_model_config_path=os.path.join(local_dir, "huggingface"),
    )
    merger = FSDPModelMerger(config)
    original = getattr(FSDPModelMerger.merge_and_save, "__wrapped__", FSDPModelMerger.merge_and_save)
    try:
        original(merger)
    except SystemExit as exc:  # verl exits 1 after writing when the checkpoint has no tokenizer
        return int(exc.code or 0)
    return 0


def run_child(body, *args) -> None:
    """Body of a forked child: never returns into the parent's code."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = 0
    try:
        result = body(*args)
        code = int(result or 0)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 3
    finally:
        os._exit(code)
