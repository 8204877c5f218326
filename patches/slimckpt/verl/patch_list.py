"""Every change slimckpt makes to verl, in one place.

Each entry names the verl attribute it replaces (or the verl table it adds an entry to), the
feature that switches it on (see `slimckpt.verl.features`) and why. Implementations are named by
`module:function` and imported only when a patch is applied, so this list imports none of them.
tests/verl/test_registry.py freezes the set of targets, so an upstream rename fails in CI instead of
silently turning a patch off.
"""

from __future__ import annotations

from slimckpt.verl.registry import Patch

CKPT_MANAGER = "verl.utils.checkpoint.fsdp_checkpoint_manager:FSDPCheckpointManager"
TRANSFORMER_IMPL = "verl.workers.engine.fsdp.transformer_impl"


def _cpu_patches() -> list[Patch]:
    """Feature "cpu" (SLIMCKPT_CPU=1): verl's trainer on a host without an accelerator."""
    agent_loop = "verl.experimental.agent_loop.agent_loop:AgentLoopWorker._run_agent_loop"
    fixes, registrations = "slimckpt_cpu.fixes", "slimckpt_cpu.registrations"
    return [
        Patch(
            "cpu.platform",
            "verl.plugin.platform.platform_manager:_detect_platform_name",
            "cpu",
            f"{fixes}:detect_platform_patch",
            why="select slimckpt's 'cpu' platform (refused where a GPU is visible, unless SLIMCKPT_CPU_FORCE=1)",
        ),
        Patch(
            "cpu.platform.registry",
            "verl.plugin.platform.platform_manager:PlatformRegistry._platforms",
            "cpu",
            f"{registrations}:platform_class",
            key=("cpu",),
            why="verl platform 'cpu': host tensors, gloo collectives, host RNG and memory calls",
        ),
        Patch(
            "cpu.rollout.replica",
            "verl.workers.rollout.replica:RolloutReplicaRegistry._registry",
            "cpu",
            f"{registrations}:replica_loader",
            key=("hf",),
            why="rollout backend 'hf' (actor_rollout_ref.rollout.name=hf): a Hugging Face model on the host",
        ),
        Patch(
            "cpu.rollout.adapter",
            "verl.workers.rollout.base:_ROLLOUT_REGISTRY",
            "cpu",
            f"{registrations}:adapter_path",
            key=(("hf", "async"),),
            why="the in-worker half of rollout 'hf'",
        ),
        *[
            Patch(
                f"cpu.engine.{model}.{backend}",
                "verl.workers.engine.base:EngineRegistry._engines",
                "cpu",
                f"{registrations}:cuda_engine",
                key=(model, backend, "cpu"),
                after=TRANSFORMER_IMPL,
                why=f"verl registers its {backend} {model} engine for cuda and npu only; it runs on host tensors too",
            )
            for model in ("language_model", "value_model")
            for backend in ("fsdp", "fsdp2")
        ],
        Patch(
            "cpu.process_group",
            "verl.utils.distributed:initialize_global_process_group_ray",
            "cpu",
            f"{fixes}:process_group_ray_patch",
            why="plain 'gloo' instead of 'cpu:gloo,cpu:gloo'",
        ),
        Patch(
            "cpu.process_group.workers",
            "verl.workers.engine_workers:initialize_global_process_group_ray",
            "cpu",
            f"{fixes}:process_group_ray_patch",
            why="same, where engine_workers imported it",
        ),
        Patch(
            "cpu.process_group.torchrun",
            "verl.utils.distributed:initialize_global_process_group",
            "cpu",
            f"{fixes}:process_group_torchrun_patch",
            why="same, for verl's torchrun entry points",
        ),
        Patch(
            "cpu.valuehead",
            "verl.utils.model:load_valuehead_model",
            "cpu",
            f"{fixes}:valuehead_patch",
            why="critic loader without its hard-coded flash_attention_2",
        ),
        Patch(
            "cpu.offload_policy",
            f"{TRANSFORMER_IMPL}:CPUOffloadPolicy",
            "cpu",
            f"{fixes}:offload_policy_patch",
            why="ref model's offload policy without pinned memory",
        ),
        Patch(
            "cpu.sample_key",
            agent_loop,
            "cpu",
            "slimckpt_cpu.sample_keys:wrap_run_agent_loop",
            why="remember each trajectory's (step, index, n) for seeded hf sampling",
        ),
        Patch(
            "cpu.sample_key.client",
            "verl.workers.rollout.llm_server:LLMServerClient.generate",
            "cpu",
            "slimckpt_cpu.sample_keys:wrap_client_generate",
            why="send that key to the hf rollout server",
        ),
        Patch(
            "cpu.batch_order",
            "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._materialize_batch",
            "cpu",
            "slimckpt_cpu.batch_order:wrap_materialize_batch",
            why="a step's trajectories in dataset order, not completion order: runs repeat bit for bit",
        ),
    ]


def _flowrl_patches() -> list[Patch]:
    """Feature "flowrl" (building slimckpt_flowrl.config.FlowRLLossConfig, i.e. +algo=flowrl)."""
    engine = f"{TRANSFORMER_IMPL}:FSDPEngine"
    lm_engine = f"{TRANSFORMER_IMPL}:FSDPEngineWithLMHead"
    impl = "slimckpt_flowrl.patches"
    return [
        Patch(
            "flowrl.loss.registry",
            "verl.trainer.ppo.core_algos:POLICY_LOSS_REGISTRY",
            "flowrl",
            "slimckpt_flowrl.loss:registered_loss",
            key=("flowrl",),
            why="FlowRL: the policy loss 'flowrl' (policy_loss.loss_mode=flowrl)",
        ),
        Patch(
            "flowrl.head",
            f"{engine}._build_module",
            "flowrl",
            f"{impl}:wrap_build_module",
            why="FlowRL: the trainable actor gets the log Z head (trained, sharded and checkpointed with it)",
        ),
        Patch(
            "flowrl.pooling",
            f"{lm_engine}.prepare_model_inputs",
            "flowrl",
            f"{impl}:wrap_prepare_model_inputs",
            why="FlowRL: each micro-batch's prompt pooling for the log Z head",
        ),
        Patch(
            "flowrl.log_z",
            f"{lm_engine}.prepare_model_outputs",
            "flowrl",
            f"{impl}:wrap_prepare_model_outputs",
            why="FlowRL: log Z into the model output the loss receives",
        ),
        Patch(
            "flowrl.loss",
            "verl.workers.engine_workers:ppo_loss",
            "flowrl",
            f"{impl}:wrap_ppo_loss",
            why="FlowRL: log Z and ref log-probs for the registered policy loss 'flowrl'",
        ),
        Patch(
            "flowrl.sync",
            f"{engine}.get_per_tensor_param",
            "flowrl",
            f"{impl}:wrap_per_tensor_param",
            why="FlowRL: the rollout engine never receives the log Z head",
        ),
        Patch(
            "flowrl.sync.shard",
            f"{engine}.get_per_tensor_param_shard",
            "flowrl",
            f"{impl}:wrap_per_tensor_param",
            why="same, for the sharded weight sync",
        ),
        Patch(
            "flowrl.hf_model",
            "verl.utils.checkpoint.fsdp_checkpoint_manager:get_fsdp_full_state_dict",
            "flowrl",
            f"{impl}:wrap_full_state_dict",
            why="FlowRL: verl's hf_model save leaves out the log Z head",
        ),
    ]


# verl 0.9.1 has two PPO trainers (v1 `PPOTrainer`, the legacy `RayPPOTrainer`); each binds the
# names it imports, so a patch of trainer code goes into both modules.
TRAINERS = (
    ("v1", "verl.trainer.ppo.v1.trainer_base", "PPOTrainer"),
    ("legacy", "verl.trainer.ppo.ray_trainer", "RayPPOTrainer"),
)


def _in_both_trainers(name: str, attr: str, make: str, why: str) -> list[Patch]:
    """One "checkpoint" Patch per trainer module; `attr` may name the trainer class as {trainer}."""
    return [
        Patch(
            name=f"{name}.{kind}", target=f"{mod}:{attr.format(trainer=cls)}", feature="checkpoint", make=make, why=why
        )
        for kind, mod, cls in TRAINERS
    ]


PATCHES: list[Patch] = [
    Patch(
        "measure.save",
        f"{CKPT_MANAGER}.save_checkpoint",
        "measure",
        "slimckpt.verl.checkpoint_patches:wrap_save_measured",
        why="SLIMCKPT_MEASURE=1: seconds, peak RSS and bytes of verl's own save, reported outside the checkpoint; "
        "the save itself runs unchanged",
    ),
    Patch(
        "checkpoint.save",
        f"{CKPT_MANAGER}.save_checkpoint",
        "checkpoint",
        "slimckpt.verl.checkpoint_patches:wrap_save_checkpoint",
        why="route recipe saves through slimckpt (measured unless the recipe's measure=false)",
    ),
    Patch(
        "checkpoint.load",
        f"{CKPT_MANAGER}.load_checkpoint",
        "checkpoint",
        "slimckpt.verl.checkpoint_patches:wrap_load_checkpoint",
        why="load the incremental tier's DCP resume state (any world size); verl's own format otherwise",
    ),
    *_in_both_trainers(
        "checkpoint.tracker",
        "{trainer}._save_checkpoint",
        "slimckpt.save.driver.tracker:wrap_trainer_save_checkpoint",
        "with async incremental saves, move latest_checkpointed_iteration.txt only to committed steps",
    ),
    *_in_both_trainers(
        "checkpoint.tracker_write",
        "open",
        "slimckpt.save.driver.tracker_write:wrap_open",
        "verl writes latest_checkpointed_iteration.txt with open(path, 'w') then write: the trainer's write of it "
        "goes to a temporary file renamed into place, so a kill mid-write leaves the previous step named",
    ),
    *_in_both_trainers(
        "checkpoint.intact_resume",
        "{trainer}._load_checkpoint",
        "slimckpt.resume.intact_resume:wrap_trainer_load_checkpoint",
        "resume_mode=auto goes on from the newest intact step when the tracker's step is damaged on disk (one line, "
        "the tracker moved to it); resume_from_path naming a damaged step refuses in one line",
    ),
    *_in_both_trainers(
        "checkpoint.tracker_read",
        "find_latest_ckpt_path",
        "slimckpt.resume.tracker_recovery:wrap_find_latest_ckpt_path",
        "verl writes latest_checkpointed_iteration.txt non-atomically; an empty one (a kill mid-write) resumes from "
        "the newest complete step instead of crashing on int('')",
    ),
    *_in_both_trainers(
        "checkpoint.storage_os",
        "os",
        "slimckpt.save.driver.trainer_storage:wrap_os",
        "trainer.default_local_dir=s3://...: a URL counts as absolute (verl joins any other path onto the working "
        "dir) and os.path.exists of one (data.pt) asks its storage",
    ),
    *_in_both_trainers(
        "checkpoint.storage_torch",
        "torch",
        "slimckpt.save.driver.trainer_storage:wrap_torch",
        "trainer.default_local_dir=s3://...: the trainer's data.pt is one atomic put to the storage, and read "
        "back with pickle_policy's globals only",
    ),
    Patch(
        "checkpoint.storage_mkdir",
        "verl.utils.fs:local_mkdir_safe",
        "checkpoint",
        "slimckpt.save.driver.trainer_storage:wrap_local_mkdir_safe",
        why="trainer.default_local_dir=s3://...: the step folder verl's trainer makes is the storage's, not "
        "<cwd>/s3:/...",
    ),
    *[
        Patch(
            f"checkpoint.stream_guard.{name}",
            f"{TRANSFORMER_IMPL}:{target}",
            "checkpoint",
            f"slimckpt.save.modes.stream_guards:{make}",
            why=f"async_save=stream: {why}",
        )
        for name, target, make, why in (
            (
                "offload_model",
                "offload_fsdp_model_to_cpu",
                "wrap_offload_model",
                "the background write follows the parameters to the host copies the offload makes",
            ),
            (
                "load_model",
                "load_fsdp_model_to_gpu",
                "wrap_load_model",
                "the background write keeps the host parameters the reload drops until it has read them",
            ),
            (
                "offload_optimizer",
                "offload_fsdp_optimizer",
                "wrap_offload_optimizer",
                "the background write follows the optimizer state to the host copies the offload makes",
            ),
            (
                "load_optimizer",
                "load_fsdp_optimizer",
                "wrap_load_optimizer",
                "the background write keeps the host optimizer state the reload drops until it has read it",
            ),
            (
                "merged_lora",
                "merged_lora_context",
                "wrap_merged_lora",
                "merge LoRA into the base weights only once the background write no longer reads the live shards",
            ),
        )
    ],
    Patch(
        "checkpoint.retention.before",
        "verl.utils.checkpoint.checkpoint_manager:BaseCheckpointManager.ensure_checkpoint_capacity",
        "checkpoint",
        "slimckpt.verl.checkpoint_patches:wrap_ensure_checkpoint_capacity",
        why="verl deletes old steps at the start of a save, before the new one exists: defer it",
    ),
    Patch(
        "checkpoint.retention.after",
        "verl.utils.checkpoint.checkpoint_manager:BaseCheckpointManager.register_checkpoint",
        "checkpoint",
        "slimckpt.verl.checkpoint_patches:wrap_register_checkpoint",
        why="delete old steps only once the new one is complete, never the tracker's step or a locked one",
    ),
    Patch(
        "adopt.startup",
        "verl.utils.config:validate_config",
        "adopt",
        "slimckpt.verl.adopt_startup:wrap_validate_config",
        why="in verl's driver: resume the job's newest step in either checkpoint dir and format (a recipe moves "
        "default_local_dir), or stop in one line where the run cannot load it; name what a recipe sets "
        "outside checkpointing",
    ),
    Patch(
        "checkpoint.best_metric.init",
        "verl.utils.tracking:Tracking.__init__",
        "checkpoint",
        "slimckpt.save.retention.best_metric:wrap_tracking_init",
        why="in verl's trainer: note where a run whose checkpoint config has keep_best saves its steps",
    ),
    Patch(
        "checkpoint.best_metric.log",
        "verl.utils.tracking:Tracking.log",
        "checkpoint",
        "slimckpt.save.retention.best_metric:wrap_tracking_log",
        why="record each save step's logged metrics next to it, for retention's keep_best (only with keep_best)",
    ),
    *_cpu_patches(),
    Patch(
        "merge.fsdp",
        "verl.model_merger.fsdp_model_merger:FSDPModelMerger.merge_and_save",
        "merge",
        "slimckpt.merge.verl_merger:wrap_merge_and_save",
        why="`python -m verl.model_merger merge --backend fsdp` streams shards to safetensors (bounded memory, "
        "atomic commit)",
    ),
    *_flowrl_patches(),
    Patch(
        "merge.drop_flowrl",
        "verl.model_merger.base_model_merger:BaseModelMerger.save_hf_model_and_tokenizer",
        "merge",
        "slimckpt_flowrl.patches:wrap_save_hf_model",
        why="verl's own model merger (the fallback of `merge --backend fsdp`) leaves out FlowRL's log Z head",
    ),
]
