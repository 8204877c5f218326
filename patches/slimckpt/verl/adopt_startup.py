"""At start-up, in verl's driver: resume the job's newest step whatever directory and format it is
in (slimckpt.resume.adopt), and name the trainer settings a recipe changes beyond checkpointing.

Patched onto `verl.utils.config.validate_config` (feature "adopt", on whenever slimckpt is
installed): `python -m verl.trainer.main_ppo` calls it in the driver with the composed config,
before Ray starts, so a run that cannot resume stops there in one line (a SystemExit: no traceback,
no minute of Ray start-up), and a move to the other directory reaches every Ray actor as
trainer.resume_mode=resume_path. Inside Ray (verl's legacy TaskRunner validates again) it does
nothing: the driver has decided. A default_local_dir on object storage (`s3://`) is checked and
prepared by storage_startup instead (there is no second directory to adopt from).
"""

from __future__ import annotations

# lazy imports: `import verl` loads this module (the plugin applies its patch), and nothing else of
# slimckpt may load with it (omegaconf and Ray are verl's own imports) (docs/configuration.md, "What changes without a recipe")
import functools
import importlib.util
import os
from typing import Any

from omegaconf import OmegaConf, open_dict

from slimckpt.log import get_logger
from slimckpt.verl_files.version import build_note

log = get_logger("slimckpt.adopt")

SLIM_TARGET = "slimckpt.verl.checkpoint_config.SlimCheckpointConfig"


def _in_ray_worker() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def _select(config: Any, key: str, default: Any = None) -> Any:
    value = OmegaConf.select(config, key, default=default)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _sections(config: Any, use_critic: bool) -> list[tuple[str, dict]]:
    """(role, its checkpoint section as a plain dict, {} where absent) of each role the run reads."""
    from slimckpt.options.checkpoint_options import ROLE_KEYS, roles_in_use

    return [(role, _select(config, ROLE_KEYS[role], {}) or {}) for role in roles_in_use(use_critic)]


def recipe_of(config: Any) -> str | None:
    """The recipe a run's config names (None: no slimckpt checkpoint config)."""
    [(_actor, checkpoint)] = _sections(config, use_critic=False)
    if checkpoint.get("_target_") != SLIM_TARGET:
        return None
    return str(checkpoint.get("recipe") or "slimckpt")


def _roles(config: Any, use_critic: bool) -> list[tuple[str, tuple[str, ...], bool]]:
    """(role, what its load reads, whether slimckpt saves it) of each role the run reads: a RoleLoad's fields."""
    roles = []
    for name, checkpoint in _sections(config, use_critic):
        contents = checkpoint.get("load_contents") or ["model", "optimizer", "extra"]
        roles.append((name, tuple(contents), checkpoint.get("_target_") == SLIM_TARGET))
    return roles


def _absolute(path: str | None) -> str | None:
    if not path:
        return path
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def _world_size(config: Any) -> int | None:
    try:
        return int(_select(config, "trainer.n_gpus_per_node")) * int(_select(config, "trainer.nnodes"))
    except (TypeError, ValueError):
        return None


def adopt(config: Any, use_critic: bool) -> None:
    """Decide the resume of this run; stop it (SystemExit with the one line) where it cannot."""
    from slimckpt.resume.adopt import RoleLoad, plan_resume

    if _select(config, "trainer.default_hdfs_dir") is not None:
        return  # verl refuses it itself
    if _select(config, "trainer.resume_mode") == "resume_path" and "://" in str(
        _select(config, "trainer.resume_from_path")
    ):
        return  # a step on object storage: its ranks load it from there, checked as they read it
    decision = plan_resume(
        _absolute(_select(config, "trainer.default_local_dir")),
        _select(config, "trainer.resume_mode"),
        [RoleLoad(*role) for role in _roles(config, use_critic)],
        recipe_of(config),
        _absolute(_select(config, "trainer.resume_from_path")),
        _world_size(config),
    )
    if decision.action == "stop":
        raise SystemExit(decision.message)
    if decision.action == "resume":
        with open_dict(config):
            OmegaConf.update(config, "trainer.resume_mode", "resume_path")
            OmegaConf.update(config, "trainer.resume_from_path", decision.step_dir)
    if decision.message:
        log.warning("%s", decision.message)


def _verl_defaults() -> dict:
    """verl's PPO trainer config as its yaml has it (interpolations unresolved)."""
    spec = importlib.util.find_spec("verl")
    root = os.path.dirname(spec.origin) if spec and spec.origin else ""
    loaded = OmegaConf.load(os.path.join(root, "trainer", "config", "_generated_ppo_trainer.yaml"))
    return OmegaConf.to_container(loaded, resolve=False)


def _raw(tree: dict, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict):
            return None
        tree = tree.get(part)
    return tree


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if not isinstance(node, dict):
        return [(prefix, node)]
    return [leaf for key, value in node.items() for leaf in _leaves(value, f"{prefix}.{key}" if prefix else str(key))]


# keys of the checkpoint sections whose recipe value bounds disk and that a user of verl's defaults would not
# expect: named in the start-up line too, with what keeps everything as verl does
BOUNDING_KEYS = {"keep_optimizer_last": "null keeps every kept step's", "export_dtype": "auto exports fp32 as verl"}


def _stated(key: str) -> bool:
    # the checkpoint sections are what a recipe is for (only their bounding defaults are named);
    # ray_kwargs only carries the switch of slimckpt's own checkpoint patches to verl's trainer actor
    parts = key.split(".")
    if parts[0] == "ray_kwargs":
        return False
    return "checkpoint" not in parts or parts[-1] in BOUNDING_KEYS


def _resolved_as(config: Any, raw: Any) -> Any:
    """`raw` (absolute interpolations included) resolved against this config."""
    if not (isinstance(raw, str) and "${" in raw):
        return raw
    # a node whose parent is the config resolves ${a.b} from the config's root, without a copy of it
    return OmegaConf.create({"value": raw}, parent=config).value


def recipe_settings_line(config: Any, recipe: str) -> str:
    """One line naming what the recipe sets outside the checkpoint sections, where this run keeps
    the recipe's value and it is not verl's default, and the checkpoint sections' bounding defaults
    (BOUNDING_KEYS) the run keeps ("" when nothing is left)."""
    from slimckpt.verl.recipes import CONF_DIR

    path = CONF_DIR / "recipe" / f"{recipe}.yaml"
    if not path.is_file():
        return ""
    ours = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    defaults = _verl_defaults()
    changed = []
    for key, raw in _leaves(ours):
        if not _stated(key):
            continue
        value = _select(config, key)
        if value != _resolved_as(config, raw):
            continue  # the user set it
        leaf = key.rsplit(".", 1)[-1]
        if "checkpoint" in key.split("."):
            changed.append(f"{key}={_show(value)} ({BOUNDING_KEYS[leaf]})")
            continue
        verl_value = _resolved_as(config, _raw(defaults, key))
        if value != verl_value:
            changed.append(f"{key}={_show(value)} (verl's default: {_show(verl_value)})")
    if not changed:
        return ""
    return (
        f"slimckpt: +recipe={recipe} also sets {', '.join(changed)}; "
        f"set any of them after +recipe={recipe} to change it"
    )


def _show(value: Any) -> str:
    return "null" if value is None else str(value)


def _say_recipe_settings(config: Any) -> None:
    recipe = recipe_of(config)
    try:
        line = recipe_settings_line(config, recipe) if recipe else ""
    except Exception as exc:  # noqa: BLE001 - a line of information must not stop a run
        line = f"slimckpt: could not list what +recipe={recipe} sets outside checkpointing ({exc})"
    if line:
        log.warning("%s", line)


MODEL_ONLY = "model_only"
MODEL_ONLY_RECIPES = ("quickstart", "intermediate")


def model_only_line(config: Any) -> str | None:
    """A model-only recipe's steps go to `<verl's default dir>/model_only` unless the user's own
    trainer.default_local_dir replaces it; then they go where the user said, beside any verl steps
    there. What keeps a later run without the recipe (which loads the optimizer) from resuming one of
    them is adopt's start-up check (it stops in one line), not the directory: this line says so."""
    if recipe_of(config) not in MODEL_ONLY_RECIPES:
        return None
    path = str(_select(config, "trainer.default_local_dir") or "")
    if not path or path.rstrip("/").rsplit("/", 1)[-1] == MODEL_ONLY:
        return None
    recipe = recipe_of(config)
    return (
        f"slimckpt: +recipe={recipe} saves model-only steps in {path} (your trainer.default_local_dir; the "
        f"recipe's own is <verl's default dir>/{MODEL_ONLY}); a later run without +recipe={recipe} that finds one "
        f"there stops at start-up in one line instead of resuming without its optimizer"
    )


def _say_build() -> None:

    try:
        line = build_note()
    except Exception as exc:  # noqa: BLE001 - a line of information must not stop a run
        line = f"slimckpt: could not read how verl was installed ({exc})"
    if line:
        log.warning("%s", line)


def wrap_validate_config(original):
    @functools.wraps(original)
    def validate_config(config, use_reference_policy: bool, use_critic: bool, *args, **kwargs):
        result = original(config, use_reference_policy, use_critic, *args, **kwargs)
        if not _in_ray_worker():
            from slimckpt.verl.fsdp1_note import say_fsdp1_cost
            from slimckpt.verl.storage_startup import on_object_storage

            _say_build()
            # first: what object storage refuses or switches off, so the lines below name what the run keeps
            on_storage = on_object_storage(config, use_critic)
            where = model_only_line(config)
            if where:
                log.warning("%s", where)
            _say_recipe_settings(config)
            say_fsdp1_cost(config, use_critic, use_reference_policy)
            if not on_storage:  # a URL: one dir, its steps found by their manifests
                adopt(config, use_critic)
        return result

    return validate_config
