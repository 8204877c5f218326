"""`slimckpt dryrun <hydra overrides...>`: compose verl's PPO config exactly as
`python -m verl.trainer.main_ppo` would, print it, and validate it against verl's own config
dataclasses without starting Ray, loading weights or touching a GPU.

Why: a 70B job spends many minutes in Ray start-up, model loading and vLLM warm-up before verl
builds the dataclasses that reject a typo in a recipe. Everything checked here is checked by
verl's own code (the same functions, or the same steps reproduced with a pointer to where verl
does them), so a config that passes here fails later only for reasons that need the cluster:
model files, data files, GPU memory, network.

Steps, in the order verl takes them:
  1. compose: Hydra, module `verl.trainer.config`, config `ppo_trainer` (main_ppo's
     @hydra.main), with slimckpt's groups on the search path (the installed Hydra plugin);
  2. resolve every interpolation (TaskRunner.run does OmegaConf.resolve) and look for `???`
     values left in the sections this run uses;
  3. `verl.utils.config.validate_config` (main_ppo.main), which builds the actor and critic
     dataclasses, including each `checkpoint._target_` (verl's CheckpointConfig or slimckpt's
     SlimCheckpointConfig);
  4. the dataclasses the trainer and workers build later: the HF model configs, the ref
     config (engine_workers.init_model), RolloutConfig and its tensor-parallel layout,
     AlgoConfig, CheckpointEngineConfig, the checkpoint callback, trainer.resume_mode, and the
     names verl looks up in registries (rollout backend, advantage estimator, policy loss);
  5. slimckpt's own checks: a slimckpt group file (recipe, size, cluster, algo) sets only keys
     verl has (Hydra would add a misspelt one silently, see config_keys.py), and a checkpoint's
     load_contents is a subset of its save_contents.

Model configs need the model's files (HFModelConfig reads config.json and the tokenizer). When
the model path is not a local directory, its keys are checked against HFModelConfig's fields
only, and the report says so.
"""

# lazy imports: Hydra, omegaconf and verl only once a config is composed (`--help` is instant)
from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import importlib
import io
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

from slimckpt import SlimckptError
from slimckpt.log import get_logger
from slimckpt.verl.config_keys import unknown_keys, unknown_keys_in_file
from slimckpt.verl.recipes import GROUPS, format_options, list_group

# verl's trainer module and config name, as in verl/trainer/main_ppo.py's @hydra.main
CONFIG_MODULE = "verl.trainer.config"
DEFAULT_CONFIG_NAME = "ppo_trainer"


class DryRunError(SlimckptError):
    """A config that verl would reject (or Hydra could not compose); str() is the one-line reason,
    `details` optional extra lines (e.g. the available recipes)."""

    def __init__(self, reason: str, details: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.details = details


@dataclass
class Report:
    """What validation did; `notes` are checks that could not run here and why."""

    checks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    verl_output: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- compose


def compose_config(overrides: list[str], config_name: str = DEFAULT_CONFIG_NAME):
    """The DictConfig main_ppo would receive for these command-line overrides."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException

    # a test or caller may have left an initialised Hydra behind; compose needs a fresh one
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
            return compose(config_name=config_name, overrides=list(overrides))
    except MissingConfigException as e:
        raise _missing_config_error(e, config_name) from None
    except HydraException as e:
        raise _hydra_error(e, config_name) from None
    except Exception as e:  # OmegaConf errors surface here for bad values, e.g. a list into an int
        raise DryRunError(_one_line(f"{type(e).__name__}: {e}")) from None


def _missing_config_error(e: Exception, config_name: str) -> DryRunError:
    text = str(e)
    m = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
    if m and m.group(1) in GROUPS:
        group, name = m.group(1), m.group(2)
        what = "recipe" if group == "recipe" else f"{group} override"
        return DryRunError(
            f"+{group}={name}: no such {what}; choose one of the files below "
            f"(slimckpt/conf/{group}/*.yaml) or add {name}.yaml there",
            details=format_options(group),
        )
    if re.search(rf"Cannot find primary config '{re.escape(config_name)}'", text):
        return DryRunError(f"--config-name {config_name}: verl has no such config in {CONFIG_MODULE}")
    return DryRunError(_one_line(text))


def _hydra_error(e: Exception, config_name: str) -> DryRunError:
    text = str(e)
    m = re.search(r"Could not override '([^']+)'\.\s*To append to your config use \+(\S+)", text)
    if not m:
        return DryRunError(_one_line(text))
    key = m.group(1)
    # Hydra's advice (append with +) is right for a new key and wrong for a typo: name the likely key
    hint = ""
    parent_key, _, leaf = key.rpartition(".")
    try:
        from omegaconf import OmegaConf

        base = _base_config(config_name)
        parent = OmegaConf.select(base, parent_key) if parent_key else base
        if OmegaConf.is_dict(parent):
            close = difflib.get_close_matches(leaf, [str(k) for k in parent.keys()], n=1, cutoff=0.6)
            if close:
                hint = f" (did you mean {parent_key + '.' if parent_key else ''}{close[0]}?)"
    except DryRunError:
        pass
    return DryRunError(f"{key} is not a key of verl's config{hint}; to add a new key on purpose write +{m.group(2)}")


def _one_line(text: str) -> str:
    # Hydra appends the whole search path to some messages: useful once, noise in one line
    text = text.split("\nConfig search path:")[0]
    parts = [p.strip() for p in text.strip().splitlines() if p.strip()]
    return " ".join(parts)


# --------------------------------------------------------------------------- keys verl does not have

_ADD = re.compile(r"^\+\+?([A-Za-z_][\w.\-]*)=")


def check_added_keys(overrides: list[str], config_name: str = DEFAULT_CONFIG_NAME, composed=None) -> list[str]:
    """Raise if a slimckpt group file named in `overrides` sets a key verl does not have (Hydra
    would add it silently); return warnings for such keys added on the command line with `+`."""
    wanted = [(m.group(1), o.split("=", 1)[1]) for o in overrides if (m := _ADD.match(o))]
    group_files = [(g, v) for g, v in wanted if g in GROUPS]
    cli_keys = [g for g, _ in wanted if g not in GROUPS]
    if not group_files and not cli_keys:
        return []
    base = _base_config(config_name)
    for group, name in group_files:
        option = next((o for o in list_group(group) if o.name == name), None)
        if option is None:
            continue  # compose already reported it
        bad = unknown_keys_in_file(base, option.path)
        if bad:
            raise DryRunError(
                f"{option.path.name} ({group}) sets {', '.join(bad)}, which verl 0.9.1's config does not have "
                f"(Hydra adds it silently and verl never reads it); fix the key in {option.path.resolve()}"
            )
    # the composed config carries the _target_ a recipe swapped in, whose fields decide what is accepted
    return [
        f"+{k}: not a key of verl's config; verl will not read it (typo?)"
        for k in unknown_keys(base, cli_keys, composed)
    ]


_BASE_CACHE: dict[str, Any] = {}


def _base_config(config_name: str):
    if config_name not in _BASE_CACHE:
        _BASE_CACHE[config_name] = compose_config([], config_name)
    return _BASE_CACHE[config_name]


# --------------------------------------------------------------------------- validate


def validate(cfg) -> Report:
    """Run verl's pre-flight checks on a composed config; raise DryRunError on the first failure."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

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
        from omegaconf import open_dict

        with open_dict(validation_cfg.critic):
            validation_cfg.critic.model = None
    from verl.utils.config import validate_config

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
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        # like TaskRunner.run: resolve everything, tolerate ??? (checked per section below)
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise DryRunError(
            f"cannot resolve {key or 'an interpolation'}: {_one_line(str(e).split('    full_key')[0])}"
        ) from None


def _check_missing(cfg, use_critic: bool) -> None:
    from omegaconf import OmegaConf

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
    from omegaconf import OmegaConf
    from verl.workers.config import HFModelConfig

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
        raise DryRunError(f"{key}: {_one_line(str(e).split('    full_key')[0])}") from None
    report.checks.append(f"{key}: keys and types match HFModelConfig")
    report.notes.append(
        f"{key}.path={section.path} is not a local directory here: its config.json and tokenizer are "
        "read only when the run starts"
    )
    return False


def _check_ref(report: Report, cfg) -> None:
    from omegaconf import open_dict

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
    from verl.trainer.ppo import core_algos
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    # workers import these before building anything (import_external_libs); registrations may live there
    for lib in _as_list(cfg.actor_rollout_ref.model.get("external_lib")):
        try:
            importlib.import_module(lib)
        except Exception as e:
            raise DryRunError(
                f"actor_rollout_ref.model.external_lib={lib}: cannot import ({_one_line(str(e))})"
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
    from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback

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
    sections = ["actor_rollout_ref.actor.checkpoint"]
    if use_critic:
        sections.append("critic.checkpoint")
    elif "checkpoint" in cfg.critic:
        # verl never builds it without a critic, but a recipe's typo there would bite the next PPO run
        sections.append("critic.checkpoint")
    from omegaconf import OmegaConf

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
    from verl.utils.config import omega_conf_to_dataclass

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
    return _one_line(text.split("    full_key")[0]) + where


# --------------------------------------------------------------------------- CLI


def _select(cfg, keys: list[str]) -> str:
    from omegaconf import OmegaConf

    chunks = []
    for key in keys:
        value = OmegaConf.select(cfg, key, default="<absent>", throw_on_missing=False)
        if OmegaConf.is_config(value):
            body = OmegaConf.to_yaml(value, resolve=True).rstrip()
            chunks.append(f"{key}:\n" + "\n".join("  " + line for line in body.splitlines()))
        else:
            chunks.append(f"{key}: {value}")
    return "\n".join(chunks)


# --------------------------------------------------------------------------- reading a composed config


def select(cfg, key: str, default: Any = None) -> Any:
    """The value at dotted `key` of a composed config, or `default` where it is missing."""
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=default, throw_on_missing=False)


def plain(node) -> Any:
    """A config node as plain dicts and lists, interpolations resolved (None stays None)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if node is not None else None


def roles_needed(cfg) -> tuple[bool, bool]:
    """(critic, reference policy): whether verl's trainer builds them for this config."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    return bool(need_critic(cfg)), bool(need_reference_policy(cfg))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slimckpt dryrun",
        description=(
            "Compose verl's PPO config as `python -m verl.trainer.main_ppo` would, print it and validate it "
            "against verl's config dataclasses. No Ray, no GPU, no model weights. Every argument that is not an "
            "option below is a Hydra override, exactly as you would pass it to main_ppo."
        ),
        epilog=(
            "examples:\n"
            "  slimckpt dryrun +recipe=quickstart +size=70b +cluster=4x8 +algo=ppo\n"
            "  slimckpt dryrun --show actor_rollout_ref.actor.checkpoint,trainer.save_freq "
            "+recipe=quickstart +size=7b\n"
            "  bash scripts/train_70b.sh --dry-run +recipe=quickstart   (the launcher calls this)\n"
            "exit status: 0 config OK, 1 verl would reject the config, 2 Hydra could not compose it"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config-name", "-cn", default=DEFAULT_CONFIG_NAME, help="verl config name (default: %(default)s)"
    )
    parser.add_argument(
        "--show",
        metavar="KEYS",
        help="print only these dotted keys (comma-separated), e.g. actor_rollout_ref.actor.checkpoint,trainer",
    )
    parser.add_argument("--no-print", action="store_true", help="validate only; print no config")
    parser.add_argument("--unresolved", action="store_true", help="print ${...} interpolations as written")
    parser.add_argument("--no-validate", action="store_true", help="compose and print only")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every check and verl's own messages")
    return parser


def main(argv: list[str] | None = None, extend=None, after=None) -> int:
    """`extend(parser)` adds options (the top-level command's plan); `after(args, overrides)` runs
    once the config passed and returns the exit status."""
    parser = build_parser()
    if extend is not None:
        extend(parser)
    args, overrides = parser.parse_known_args(argv)
    stray = [a for a in overrides if a.startswith("-")]
    if stray:
        parser.error(f"unknown option {stray[0]} (Hydra overrides look like key=value, +key=value or ~key)")
    # building a recipe's SlimCheckpointConfig applies slimckpt's patches in this process and logs
    # each one: true, but noise in a dry run. Only this call is quietened (not the environment,
    # which child processes and later callers in the same process would inherit).
    slim_log = get_logger()
    previous = slim_log.level
    if not args.verbose:
        slim_log.setLevel(logging.WARNING)
    try:
        code = _run(args, overrides)
        return after(args, overrides) if code == 0 and after is not None else code
    finally:
        slim_log.setLevel(previous)


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    try:
        cfg = compose_config(overrides, args.config_name)
    except DryRunError as e:
        _fail(e)
        return 2
    try:
        key_warnings = check_added_keys(overrides, args.config_name, cfg)
    except DryRunError as e:
        _fail(e)
        return 1

    if not args.no_print:
        from omegaconf import OmegaConf

        try:
            if args.show:
                print(_select(cfg, [k.strip() for k in args.show.split(",") if k.strip()]))
            else:
                print(OmegaConf.to_yaml(cfg, resolve=not args.unresolved), end="")
        except Exception as e:  # a broken interpolation shows up while printing resolved values
            _fail(DryRunError(f"cannot resolve the config: {_one_line(str(e).split('    full_key')[0])}"))
            return 1
        sys.stdout.flush()

    if args.no_validate:
        print("config composed (not validated)")
        return 0
    try:
        report = validate(cfg)
    except DryRunError as e:
        _fail(e)
        return 1
    if args.verbose:
        for line in report.verl_output:
            print(f"  verl: {line}", file=sys.stderr)
        for check in report.checks:
            print(f"  ok: {check}", file=sys.stderr)
    for warning in key_warnings + report.warnings:
        print(f"  warning: {warning}", file=sys.stderr)
    for note in report.notes:
        print(f"  not checked: {note}", file=sys.stderr)
    print(f"config OK ({len(report.checks)} checks; {len(report.notes)} left for the cluster)")
    return 0


def _fail(e: DryRunError) -> None:
    sys.stdout.flush()
    print(f"slimckpt.dryrun: config error: {e.reason}", file=sys.stderr)
    if e.details:
        print(e.details, file=sys.stderr)
