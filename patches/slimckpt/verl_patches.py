"""Every patch slimckpt applies to verl, in one place.

Each entry names the verl attribute it replaces, the feature that switches it on (see
`slimckpt.plugin`) and why. Implementations live in their own modules and are imported only
when a patch is applied. tests/test_registry.py freezes the set of targets, so an upstream
rename fails in CI instead of silently turning a patch off.
"""

from __future__ import annotations

from .registry import REGISTRY, Patch

CKPT_MANAGER = "verl.utils.checkpoint.fsdp_checkpoint_manager:FSDPCheckpointManager"


def _save_checkpoint(original):
    from .checkpoint_hooks import wrap_save_checkpoint

    return wrap_save_checkpoint(original)


def _cpu(fix: str):
    """Feature "cpu" (SLIMCKPT_CPU=1): `make` for the named builder in slimckpt.cpu.fixes/sample_keys."""

    def make(original):
        import importlib

        module, _, name = fix.rpartition(".")
        return getattr(importlib.import_module(f"slimckpt.cpu.{module}"), name)(original)

    return make


def _cpu_patches() -> list[Patch]:
    agent_loop = "verl.experimental.agent_loop.agent_loop:AgentLoopWorker._run_agent_loop"
    return [
        Patch("cpu.platform", "verl.plugin.platform.platform_manager:_detect_platform_name", "cpu",
              _cpu("fixes.detect_platform_patch"),
              why="select slimckpt's 'cpu' platform; registers it, the hf rollout and cpu FSDP engines"),
        Patch("cpu.process_group", "verl.utils.distributed:initialize_global_process_group_ray", "cpu",
              _cpu("fixes.process_group_ray_patch"), why="plain 'gloo' instead of 'cpu:gloo,cpu:gloo'"),
        Patch("cpu.process_group.workers", "verl.workers.engine_workers:initialize_global_process_group_ray",
              "cpu", _cpu("fixes.process_group_ray_patch"), why="same, where engine_workers imported it"),
        Patch("cpu.process_group.torchrun", "verl.utils.distributed:initialize_global_process_group", "cpu",
              _cpu("fixes.process_group_torchrun_patch"), why="same, for verl's torchrun entry points"),
        Patch("cpu.valuehead", "verl.utils.model:load_valuehead_model", "cpu", _cpu("fixes.valuehead_patch"),
              why="critic loader without its hard-coded flash_attention_2"),
        Patch("cpu.offload_policy", "verl.workers.engine.fsdp.transformer_impl:CPUOffloadPolicy", "cpu",
              _cpu("fixes.offload_policy_patch"), why="ref model's offload policy without pinned memory"),
        Patch("cpu.sample_key", agent_loop, "cpu", _cpu("sample_keys.wrap_run_agent_loop"),
              why="remember each trajectory's (step, index, n) for seeded hf sampling"),
        Patch("cpu.sample_key.client", "verl.workers.rollout.llm_server:LLMServerClient.generate", "cpu",
              _cpu("sample_keys.wrap_client_generate"), why="send that key to the hf rollout server"),
        Patch("cpu.batch_order", "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._materialize_batch", "cpu",
              lambda original: __import__("slimckpt.batch_order", fromlist=["x"]).wrap_materialize_batch(original),
              why="a step's trajectories in dataset order, not completion order: runs repeat bit for bit"),
    ]


def _flowrl(fn: str):
    """Feature "flowrl" (building slimckpt.flowrl.config.FlowRLLossConfig, i.e. +algo=flowrl): `make` from
    slimckpt.flowrl.patches."""

    def make(original):
        from .flowrl import patches

        return getattr(patches, fn)(original)

    return make


def _flowrl_patches() -> list[Patch]:
    engine = "verl.workers.engine.fsdp.transformer_impl:FSDPEngine"
    lm_engine = "verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead"
    return [
        Patch("flowrl.head", f"{engine}._build_module", "flowrl", _flowrl("wrap_build_module"),
              why="FlowRL: the trainable actor gets the log Z head (trained, sharded and checkpointed with it)"),
        Patch("flowrl.pooling", f"{lm_engine}.prepare_model_inputs", "flowrl", _flowrl("wrap_prepare_model_inputs"),
              why="FlowRL: each micro-batch's prompt pooling for the log Z head"),
        Patch("flowrl.log_z", f"{lm_engine}.prepare_model_outputs", "flowrl", _flowrl("wrap_prepare_model_outputs"),
              why="FlowRL: log Z into the model output the loss receives"),
        Patch("flowrl.loss", "verl.workers.engine_workers:ppo_loss", "flowrl", _flowrl("wrap_ppo_loss"),
              why="FlowRL: log Z and ref log-probs for the registered policy loss 'flowrl'"),
        Patch("flowrl.sync", f"{engine}.get_per_tensor_param", "flowrl", _flowrl("wrap_per_tensor_param"),
              why="FlowRL: the rollout engine never receives the log Z head"),
        Patch("flowrl.sync.shard", f"{engine}.get_per_tensor_param_shard", "flowrl",
              _flowrl("wrap_per_tensor_param"), why="same, for the sharded weight sync"),
        Patch("flowrl.hf_model", "verl.utils.checkpoint.fsdp_checkpoint_manager:get_fsdp_full_state_dict", "flowrl",
              _flowrl("wrap_full_state_dict"), why="FlowRL: verl's hf_model save leaves out the log Z head"),
    ]



# verl 0.9.1 has two PPO trainers (v1 `PPOTrainer`, the legacy `RayPPOTrainer`); each binds the
# names it imports, so a patch of trainer code goes into both modules.
TRAINERS = (("v1", "verl.trainer.ppo.v1.trainer_base", "PPOTrainer"),
            ("legacy", "verl.trainer.ppo.ray_trainer", "RayPPOTrainer"))


def _in_both_trainers(name: str, attr: str, module: str, wrapper: str, why: str) -> list[Patch]:
    """One "checkpoint" Patch per trainer module; `attr` may name the trainer class as {trainer}."""
    return [
        Patch(name=f"{name}.{kind}", target=f"{mod}:{attr.format(trainer=cls)}", feature="checkpoint",
              make=lambda original: getattr(__import__(module, fromlist=["x"]), wrapper)(original), why=why)
        for kind, mod, cls in TRAINERS
    ]


PATCHES: list[Patch] = [
    Patch(
        name="checkpoint.save",
        target=f"{CKPT_MANAGER}.save_checkpoint",
        feature="checkpoint",
        make=_save_checkpoint,
        why="measure every save and route recipe saves through slimckpt",
    ),
    Patch(
        name="checkpoint.load",
        target=f"{CKPT_MANAGER}.load_checkpoint",
        feature="checkpoint",
        make=lambda original: __import__("slimckpt.resume_state", fromlist=["x"]).wrap_load_checkpoint(original),
        why="load the incremental tier's DCP resume state (any world size); verl's own format otherwise",
    ),
    *_in_both_trainers(
        "checkpoint.tracker", "{trainer}._save_checkpoint", "slimckpt.resume_tracker", "wrap_trainer_save_checkpoint",
        "with async incremental saves, move latest_checkpointed_iteration.txt only to committed steps"),
    *_in_both_trainers(
        "checkpoint.tracker_read", "find_latest_ckpt_path", "slimckpt.tracker_recovery", "wrap_find_latest_ckpt_path",
        "verl writes latest_checkpointed_iteration.txt non-atomically; an empty one (a kill mid-write) resumes from "
        "the newest complete step instead of crashing on int('')"),
    *[
        Patch(
            name=f"checkpoint.retention.{kind}",
            target=f"verl.utils.checkpoint.checkpoint_manager:BaseCheckpointManager.{attr}",
            feature="checkpoint",
            make=lambda original, fn=fn: getattr(__import__("slimckpt.retention", fromlist=["x"]), fn)(original),
            why=why,
        )
        for kind, attr, fn, why in (
            ("before", "ensure_checkpoint_capacity", "wrap_ensure_checkpoint_capacity",
             "verl deletes old steps at the start of a save, before the new one exists: defer it"),
            ("after", "register_checkpoint", "wrap_register_checkpoint",
             "delete old steps only once the new one is complete, never the tracker's step or a locked one"),
        )
    ],
    *_cpu_patches(),
    Patch(
        name="merge.fsdp",
        target="verl.model_merger.fsdp_model_merger:FSDPModelMerger.merge_and_save",
        feature="merge",
        make=lambda original: __import__("slimckpt.merge", fromlist=["x"]).wrap_merge_and_save(original),
        why="`python -m verl.model_merger merge --backend fsdp` streams shards to safetensors (bounded memory, "
            "atomic commit)",
    ),
    *_flowrl_patches(),
    Patch(
        name="merge.drop_flowrl",
        target="verl.model_merger.base_model_merger:BaseModelMerger.save_hf_model_and_tokenizer",
        feature="merge",
        make=_flowrl("wrap_save_hf_model"),
        why="verl's own model merger (the fallback of `merge --backend fsdp`) leaves out FlowRL's log Z head",
    ),
]


def register_all() -> None:
    for patch in PATCHES:
        if patch.name not in {p.name for p in REGISTRY.patches()}:
            REGISTRY.register(patch)
