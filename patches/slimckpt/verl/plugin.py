"""Entry point in verl's `verl.plugins` group (see pyproject.toml).

verl imports this module on every `import verl`, in the driver and in every Ray worker, and
swallows any exception at debug level; so this module logs its own failures at ERROR.

What it switches on, and when:
- `merge`: `python -m verl.model_merger merge --backend fsdp` goes through slimckpt's streaming
  merger (always, unless SLIMCKPT_DISABLE=1).
- `adopt`: at start-up, in verl's driver, a run resumes its job's newest step whichever
  checkpoint dir (a recipe's `model_only` or verl's) and format it is in, or stops in one line
  where it cannot load it (always, unless SLIMCKPT_DISABLE=1; slimckpt.verl.adopt_startup).
- `measure`: with SLIMCKPT_MEASURE=1, verl's save_checkpoint is timed and its peak RSS sampled;
  nothing else (verl's save, retention, tracker and load stay verl's).
- `checkpoint`: verl's FSDPCheckpointManager save/load hooks. Applied when a recipe's
  SlimCheckpointConfig is built, or when SLIMCKPT_CHECKPOINT=1 (recipes/incremental.yaml sets it in
  Ray's runtime_env, so verl's trainer actor, which never builds the config, gets the tracker patch).
- `cpu`: the CPU platform and `hf` rollout for small runs, only with SLIMCKPT_CPU=1.
Nothing is applied with SLIMCKPT_DISABLE=1. Without a recipe and SLIMCKPT_* variables, only `adopt`
(a check of verl's config validation) applies, and the merger's two patches wait (an import hook)
for verl's merger modules: README's "What changes
without +recipe=" is the whole list, and tests/verl/test_registry.py asserts it.
"""

# lazy imports: verl imports this module in every process: with SLIMCKPT_DISABLE=1 nothing more loads
from __future__ import annotations

from slimckpt import env_vars
from slimckpt.log import get_logger
from slimckpt.verl.features import switch_on
from slimckpt.verl_files.version import UnsupportedVerlVersion, check_verl_version

log = get_logger("slimckpt.plugin")


def enabled_features() -> list[str]:
    features = ["merge", "adopt"]
    if env_vars.flag("SLIMCKPT_MEASURE"):
        features.append("measure")
    if env_vars.flag("SLIMCKPT_CHECKPOINT"):
        features.append("checkpoint")
    if env_vars.flag("SLIMCKPT_CPU"):
        features.append("cpu")
    return features


def load() -> list[str]:
    """Apply the patches this process asks for; returns the features switched on."""
    if env_vars.flag("SLIMCKPT_DISABLE"):
        log.debug("SLIMCKPT_DISABLE=1: verl runs unpatched")
        return []

    try:
        check_verl_version()
    except UnsupportedVerlVersion as exc:
        # A recipe's config raises this again in the driver, where it stops the run.
        log.error("%s", exc)
        return []
    features = enabled_features()
    for feature in features:
        switch_on(feature)
    return features


try:
    load()
except Exception:  # noqa: BLE001 - verl would hide it
    log.exception("slimckpt could not load its verl patches; set SLIMCKPT_DISABLE=1 to run plain verl")
