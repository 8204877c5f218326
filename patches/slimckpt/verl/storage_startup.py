"""At start-up, in verl's driver: a run whose `trainer.default_local_dir` is on object storage (`s3://`).

Called from adopt_startup's validate_config hook, before Ray starts, so what cannot work stops there in
one line (a SystemExit, no traceback):

- only the incremental tier writes a step through the storage: the actor's (and a critic's) checkpoint
  config must be `+recipe=incremental`'s. `+recipe=quickstart`/`intermediate` and verl's own save write
  rank files and rename in place on local disk; they are refused, naming `+recipe=incremental`.
- `keep_optimizer_last` (the recipe's default: 1) rewrites a committed step's files and switches them by
  renames, which an object store has not: switched off with one line, as the export is; the kept steps
  (`max_*_ckpt_to_keep`) stay whole. An asynchronous v1 trainer mode, whose TransferQueue state verl
  writes with local writes, is refused.
- the in-training HF export writes one file from many ranks at offsets, which an object store has not
  either. The recipe turns it on by default, and one argument must be enough to save to S3: the export
  is switched off with one line naming `slimckpt merge --local_dir s3://...`, which writes the same HF
  model from any committed step afterwards.
- the storage is asked once (`check_access`: endpoint, credentials, bucket, permission), naming the fix.
- the `AWS_*` variables of the driver (endpoint, region, profile, key id, ...) are added to Ray's
  runtime_env, so that every worker of the job on every node sees the same ones. Not the secrets
  (`AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`): verl prints its config and Ray's arguments, and
  slimckpt never prints a credential. Ray's workers on the driver's node inherit them; a node started
  on its own (`ray start`) needs them in its environment (or its profile / instance role), and each
  rank's first save or load checks its access before it writes (save.step_save).
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf, open_dict

from slimckpt import env_vars
from slimckpt.log import get_logger
from slimckpt.options.checkpoint_options import ROLE_KEYS, roles_in_use
from slimckpt.storage import for_path, is_url

log = get_logger("slimckpt.storage")

SLIM_TARGET = "slimckpt.verl.checkpoint_config.SlimCheckpointConfig"
SECRET_VARS = frozenset({"AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"})
ENV_VARS_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"


def _select(config: Any, key: str, default: Any = None) -> Any:
    value = OmegaConf.select(config, key, default=default, throw_on_missing=False)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def refusal(config: Any, use_critic: bool) -> str | None:
    """The one line a run with its checkpoints on object storage stops with, or None when it can run."""
    root = str(_select(config, "trainer.default_local_dir") or "")
    for role in roles_in_use(use_critic):
        checkpoint = _select(config, ROLE_KEYS[role], {}) or {}
        incremental = checkpoint.get("_target_") == SLIM_TARGET and bool(checkpoint.get("incremental_save"))
        if not incremental:
            recipe = checkpoint.get("recipe") if checkpoint.get("_target_") == SLIM_TARGET else None
            used = f"+recipe={recipe}" if recipe else "verl's own checkpoint"
            return (
                f"slimckpt: trainer.default_local_dir={root}: {used} writes the {role}'s files on local disk only; "
                f"use +recipe=incremental to save to object storage, or give a local directory"
            )
    if _select(config, "trainer.default_hdfs_dir") is not None:
        return f"slimckpt: trainer.default_local_dir={root}: set trainer.default_hdfs_dir=null (one remote target)"
    mode = _select(config, "trainer.v1.trainer_mode", "sync")
    if _select(config, "trainer.use_v1", True) and mode not in (None, "sync"):
        return (
            f"slimckpt: trainer.default_local_dir={root}: trainer.v1.trainer_mode={mode} saves TransferQueue's "
            f"state with its own local writes; use trainer.v1.trainer_mode=sync, or save to a local directory"
        )
    return None


def forwarded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's AWS_* variables that go to every Ray worker (the secrets never: see the module doc)."""
    environ = env_vars.environment() if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith("AWS_") and k not in SECRET_VARS}


def turn_export_off(config: Any) -> str | None:
    """Switch the actor's in-training HF export off (a medium without in-place writes); the line said."""
    key = f"{ROLE_KEYS['actor']}.export_hf"
    if not _select(config, key, False):
        return None
    with open_dict(config):
        OmegaConf.update(config, key, False)
    root = str(_select(config, "trainer.default_local_dir")).rstrip("/")
    return (
        f"slimckpt: {key}=false on {root} (object storage has no in-place writes for the export); each "
        f"committed step has the same HF model with: slimckpt merge --local_dir {root}/global_step_N/actor "
        f"--target_dir <dir or s3://...>"
    )


def turn_optimizer_drop_off(config: Any, use_critic: bool) -> str | None:
    """Switch keep_optimizer_last off (it rewrites a committed step in place); the line said."""
    keys = [
        f"{ROLE_KEYS[role]}.keep_optimizer_last"
        for role in roles_in_use(use_critic)
        if _select(config, f"{ROLE_KEYS[role]}.keep_optimizer_last") is not None
    ]
    if not keys:
        return None
    with open_dict(config):
        for key in keys:
            OmegaConf.update(config, key, None)
    root = str(_select(config, "trainer.default_local_dir")).rstrip("/")
    kept = ", ".join(
        f"trainer.max_{role}_ckpt_to_keep={_select(config, f'trainer.max_{role}_ckpt_to_keep')}"
        for role in roles_in_use(use_critic)
    )
    return (
        f"slimckpt: {'/'.join(keys)}=null on {root} (dropping a committed step's optimizer state rewrites its "
        f"files in place, which object storage cannot): the kept steps stay whole, each with its optimizer "
        f"({kept})"
    )


def forward_env(config: Any) -> list[str]:
    """Add forwarded_env() to Ray's runtime_env of this run (a value the config sets already wins)."""
    env = forwarded_env()
    if not env:
        return []
    have = _select(config, ENV_VARS_KEY, {}) or {}
    added = {k: v for k, v in env.items() if k not in have}
    with open_dict(config):
        for name, value in added.items():
            OmegaConf.update(config, f"{ENV_VARS_KEY}.{name}", value, force_add=True)
    return sorted(added)


def on_object_storage(config: Any, use_critic: bool) -> bool:
    """Start-up of a run whose default_local_dir is a URL; False (nothing done) for a local one.
    Raises SystemExit with the one line where the run cannot save there."""
    root = str(_select(config, "trainer.default_local_dir") or "")
    if not is_url(root):
        return False
    line = refusal(config, use_critic)
    if line:
        raise SystemExit(line)
    try:
        for_path(root).check_access(root)
    except OSError as exc:
        raise SystemExit(str(exc).splitlines()[0] if str(exc) else f"slimckpt: {root}: {exc!r}") from None
    for said in (turn_export_off(config), turn_optimizer_drop_off(config, use_critic)):
        if said:
            log.warning("%s", said)
    names = forward_env(config)
    log.info(
        "slimckpt: checkpoints go to %s%s",
        root,
        f"; {', '.join(names)} passed to every Ray worker (secrets: from each node's environment)" if names else "",
    )
    return True


__all__ = ["forwarded_env", "on_object_storage", "refusal", "turn_export_off", "turn_optimizer_drop_off"]
