"""The checks of `slimckpt dryrun` against verl's own code, in the order verl takes them (steps 2-5 of
slimckpt.verl.dryrun): resolve, look for `???`, verl's validate_config, the dataclasses the trainer and
workers build later, the registries' names, and slimckpt's own checks of its groups' keys. It imports
verl's trainer modules, so the command loads it only once a config is composed."""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import os
import re
import warnings
from typing import Any

from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.workers.config import HFModelConfig
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.replica import RolloutReplicaRegistry

from slimckpt.options.checkpoint_options import ROLE_KEYS
from slimckpt.verl.dryrun_report import DryRunError, Report, one_line


def validate(cfg) -> Report:
    """Run verl's pre-flight checks on a composed config; raise DryRunError on the first failure."""
    report = Report()
    cfg = copy.deepcopy(cfg)  # verl's checks and our stand-ins edit the config in place

    _resolve(cfg)
    report.checks.append("all interpolations resolve")

    for key in ("trainer.nnodes", "trainer.n_gpus_per_node"):
        value = OmegaConf.select(cfg, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DryRunError(f"{key}={value!r}: must be a positive integer")
    use_critic = bool(_quiet(report, need_critic, cfg))
    use_ref = bool(need_reference_policy(cfg))
    _check_missing(cfg, use_critic)
    report.checks.append("no mandatory value (???) left in the sections this run uses")

    critic_model_loadable = _check_model(report, cfg, "critic.model") if use_critic else True
    _check_model(report, cfg, "actor_rollout_ref.model")

    # verl's validate_config instantiates critic.model (an HFModelConfig, which reads the model's
    # files); without them, swap in "no model" for that one call: CriticConfig.model defaults to None
    # and nothing in CriticConfig's own checks reads it
    validation_cfg = cfg
    if use_critic and not critic_model_loadable:
        validation_cfg = copy.deepcopy(cfg)

        with open_dict(validation_cfg.critic):
            validation_cfg.critic.model = None
    _verl_call(
        report,
        "verl validate_config",
        # verl's own: slimckpt's start-up hook around it (adopt) decides a real launch's resume
        getattr(validate_config, "__wrapped__", validate_config),
        config=validation_cfg,
        use_reference_policy=use_ref,
        use_critic=use_critic,
    )
    report.checks.append(
        "verl validate_config (ActorConfig" + (", CriticConfig" if use_critic else "") + ", batch sizes)"
    )

    if use_ref:
        _check_ref(report, cfg)
    _check_rollout(report, cfg)
    _check_registries(report, cfg)
    _build(report, cfg.algorithm, "algorithm")
    _build(report, cfg.actor_rollout_ref.rollout.checkpoint_engine, "actor_rollout_ref.rollout.checkpoint_engine")
    _check_checkpoint_callback(report, cfg)
    _check_trainer(report, cfg)
    _check_checkpoint_sections(report, cfg, use_critic)
    return report


def _resolve(cfg) -> None:

    try:
        # like TaskRunner.run: resolve everything, tolerate ??? (checked per section below)
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise DryRunError(
            f"cannot resolve {key or 'an interpolation'}: {one_line(str(e).split('    full_key')[0])}"
        ) from None


def _check_missing(cfg, use_critic: bool) -> None:

    # sections verl only reads when their feature is on; a `???` there is never seen
    unused = []
    if not OmegaConf.select(cfg, "reward.reward_model.enable", default=False):
        unused.append("reward.reward_model.")
    if not OmegaConf.select(cfg, "distillation.enabled", default=False):
        unused.append("distillation.")
    if not use_critic:
        unused.append("critic.")
    missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not any(k.startswith(u) for u in unused))
    if missing:
        hint = " (e.g. actor_rollout_ref.rollout.name=vllm)" if "actor_rollout_ref.rollout.name" in missing else ""
        raise DryRunError(f"mandatory value not set (???): {', '.join(missing)}; set it on the command line{hint}")


def _check_model(report: Report, cfg, key: str) -> bool:
    """True if the model config was fully built from local files; False if only its keys were checked."""
    section = OmegaConf.select(cfg, key)
    path = os.path.expanduser(str(section.path))
    if os.path.isdir(path):
        _build(report, section, key)
        return True
    # same key/type checking Hydra's instantiate would do, minus HFModelConfig.__post_init__
    # (which opens config.json and the tokenizer)
    try:
        OmegaConf.merge(OmegaConf.structured(HFModelConfig), OmegaConf.to_container(section, resolve=True))
    except Exception as e:
        raise DryRunError(f"{key}: {one_line(str(e).split('    full_key')[0])}") from None
    report.checks.append(f"{key}: keys and types match HFModelConfig")
    report.notes.append(
        f"{key}.path={section.path} is not a local directory here: its config.json and tokenizer are "
        "read only when the run starts"
    )
    return False


def _check_ref(report: Report, cfg) -> None:

    # what ActorRolloutRefWorker.init_model does to the ref section before building it
    # (verl/workers/engine_workers.py): the ref reuses the actor's config class with log_prob_* keys
    ref = copy.deepcopy(cfg.actor_rollout_ref.ref)
    with open_dict(ref):
        ref.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    _build(report, ref, "actor_rollout_ref.ref")


def _check_rollout(report: Report, cfg) -> None:
    rollout = _build(report, cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout", record=False)
    # ActorRolloutRefWorker.init_model asserts this on every worker once Ray is up
    world = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    infer = (
        int(rollout.tensor_model_parallel_size)
        * int(rollout.data_parallel_size)
        * int(rollout.pipeline_model_parallel_size)
    )
    if world % infer != 0:
        raise DryRunError(
            f"actor_rollout_ref.rollout: {world} GPUs (trainer.nnodes x trainer.n_gpus_per_node) are not divisible "
            f"by tensor x data x pipeline parallel = {infer}; change rollout.tensor_model_parallel_size"
        )
    if cfg.actor_rollout_ref.actor.use_dynamic_bsz != cfg.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz:
        raise DryRunError(
            "actor_rollout_ref.actor.use_dynamic_bsz and rollout.log_prob_use_dynamic_bsz differ; verl's "
            "workers assert they are equal"
        )
    report.checks.append(f"rollout ({rollout.name}): {world} GPUs / TP*DP*PP {infer}")


def _check_registries(report: Report, cfg) -> None:
    """Names verl looks up in its registries only once workers run (rollout backend, advantage
    estimator, policy loss); a typo there otherwise costs a full start-up."""
    # workers import these before building anything (import_external_libs); registrations may live there
    for lib in _as_list(cfg.actor_rollout_ref.model.get("external_lib")):
        try:
            importlib.import_module(lib)
        except Exception as e:
            raise DryRunError(
                f"actor_rollout_ref.model.external_lib={lib}: cannot import ({one_line(str(e))})"
            ) from None

    rollout = cfg.actor_rollout_ref.rollout
    replicas = sorted(RolloutReplicaRegistry._registry)
    if rollout.name not in replicas or (rollout.name, rollout.mode) not in rollout_base._ROLLOUT_REGISTRY:
        hint = " (slimckpt's hf backend needs SLIMCKPT_CPU=1)" if rollout.name == "hf" else ""
        raise DryRunError(
            f"actor_rollout_ref.rollout.name={rollout.name} (mode {rollout.mode}) is not a registered rollout backend; "
            f"registered: {', '.join(replicas)}{hint}"
        )
    estimator = cfg.algorithm.adv_estimator
    if str(estimator) not in core_algos.ADV_ESTIMATOR_REGISTRY:
        raise DryRunError(
            f"algorithm.adv_estimator={estimator} is not registered; "
            f"registered: {', '.join(sorted(core_algos.ADV_ESTIMATOR_REGISTRY))}"
        )
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if loss_mode not in core_algos.POLICY_LOSS_REGISTRY:
        raise DryRunError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} is not registered; "
            f"registered: {', '.join(sorted(core_algos.POLICY_LOSS_REGISTRY))}"
        )
    report.checks.append(f"registered: rollout {rollout.name}, advantage {estimator}, policy loss {loss_mode}")


def _as_list(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):  # verl's import_external_libs takes one module name or a list
        return [value]
    return [str(v) for v in value]


def _check_checkpoint_callback(report: Report, cfg) -> None:
    _verl_call(report, "trainer.checkpoint_callback_class", build_checkpoint_callback, cfg)
    report.checks.append("trainer.checkpoint_callback_class loads")


def _check_trainer(report: Report, cfg) -> None:
    # the trainer compares these with ints every step; a string fails only after start-up
    for key in ("save_freq", "test_freq", "total_epochs"):
        value = cfg.trainer.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise DryRunError(f"trainer.{key}={value!r}: must be an integer")
    for key in ("max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep"):
        value = cfg.trainer.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            # verl accepts it and silently keeps every checkpoint (checkpoint_manager.register_checkpoint)
            report.warnings.append(f"trainer.{key}={value!r}: verl keeps every checkpoint for this value")
    # mirrors PPOTrainer._load_checkpoint (verl/trainer/ppo/v1/trainer_base.py)
    mode = cfg.trainer.resume_mode
    if mode not in ("auto", "disable", "resume_path"):
        raise DryRunError(f"trainer.resume_mode={mode}: use auto, disable or resume_path")
    if mode == "resume_path":
        path = cfg.trainer.resume_from_path
        if not isinstance(path, str) or "global_step_" not in path:
            raise DryRunError(
                f"trainer.resume_mode=resume_path needs trainer.resume_from_path=<dir>/global_step_N (got {path!r})"
            )
    report.checks.append(f"trainer.resume_mode={mode}")


def _check_checkpoint_sections(report: Report, cfg, use_critic: bool) -> None:
    sections = [ROLE_KEYS["actor"]]
    if use_critic:
        sections.append(ROLE_KEYS["critic"])
    elif "checkpoint" in cfg.critic:
        # verl never builds it without a critic, but a recipe's typo there would bite the next PPO run
        sections.append(ROLE_KEYS["critic"])

    for key in sections:
        ckpt = _build(report, OmegaConf.select(cfg, key), key, record=False)
        save, load = list(ckpt.save_contents), list(ckpt.load_contents)
        # slimckpt's rule: resuming must not ask for what was never written (verl fails at load)
        not_saved = [c for c in load if c not in save and c != "hf_model"]
        if not_saved:
            raise DryRunError(
                f"{key}.load_contents has {not_saved} that save_contents {save} never writes: a resume would fail; "
                f"set {key}.load_contents={save}"
            )
        report.checks.append(f"{key}: {type(ckpt).__name__} save={save} load={load}")


def _build(report: Report, section, key: str, record: bool = True) -> Any:
    built = _verl_call(report, key, omega_conf_to_dataclass, section)
    if record:
        report.checks.append(f"{key}: builds {type(built).__name__}")
    return built


def _verl_call(report: Report, key: str, fn, *args, **kwargs) -> Any:
    """Call a verl function, turning its failure into one line and its prints into report lines."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            return fn(*args, **kwargs)
    except Exception as e:
        raise DryRunError(f"{key}: {_exception_reason(e)}") from None
    finally:
        report.verl_output.extend(line for line in out.getvalue().splitlines() if line.strip())


def _quiet(report: Report, fn, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    report.verl_output.extend(str(w.message) for w in caught)
    return result


def _exception_reason(e: BaseException) -> str:
    # Hydra wraps the dataclass's own error: report the innermost cause and the key it names
    inner = e
    while inner.__cause__ is not None:
        inner = inner.__cause__
    text = str(inner) or type(inner).__name__
    full_key = re.search(r"full_key: (\S+)", str(e))
    where = f" (at {full_key.group(1)})" if full_key else ""
    if isinstance(inner, TypeError) and "unexpected keyword argument" in text:
        text = f"unknown key: {text}"
    return one_line(text.split("    full_key")[0]) + where


def roles_needed(cfg) -> tuple[bool, bool]:
    """(critic, reference policy): whether verl's trainer builds them for this config."""
    return bool(need_critic(cfg)), bool(need_reference_policy(cfg))
