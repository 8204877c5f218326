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

# lazy imports: the checks (verl's trainer modules, seconds to import) only once a config composed; `slimckpt dryrun
# --help` never loads this module (its parser is verl/dryrun_args)
from __future__ import annotations

import argparse
import difflib
import logging
import re
import sys
from collections.abc import Callable
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf

from slimckpt.log import get_logger
from slimckpt.verl.config_keys import unknown_keys, unknown_keys_in_file
from slimckpt.verl.dryrun_args import CONFIG_MODULE, DEFAULT_CONFIG_NAME, build_parser, parse
from slimckpt.verl.dryrun_report import DryRunError, one_line
from slimckpt.verl.recipes import GROUPS, format_options, list_group

# --------------------------------------------------------------------------- compose


def compose_config(overrides: list[str], config_name: str = DEFAULT_CONFIG_NAME):
    """The DictConfig main_ppo would receive for these command-line overrides."""
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
        raise DryRunError(one_line(f"{type(e).__name__}: {e}")) from None


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
    return DryRunError(one_line(text))


def _hydra_error(e: Exception, config_name: str) -> DryRunError:
    text = str(e)
    m = re.search(r"Could not override '([^']+)'\.\s*To append to your config use \+(\S+)", text)
    if not m:
        return DryRunError(one_line(text))
    key = m.group(1)
    # Hydra's advice (append with +) is right for a new key and wrong for a typo: name the likely key
    hint = ""
    parent_key, _, leaf = key.rpartition(".")
    try:
        base = _base_config(config_name)
        parent = OmegaConf.select(base, parent_key) if parent_key else base
        if OmegaConf.is_dict(parent):
            close = difflib.get_close_matches(leaf, [str(k) for k in parent.keys()], n=1, cutoff=0.6)
            if close:
                hint = f" (did you mean {parent_key + '.' if parent_key else ''}{close[0]}?)"
    except DryRunError:
        pass
    return DryRunError(f"{key} is not a key of verl's config{hint}; to add a new key on purpose write +{m.group(2)}")


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


# --------------------------------------------------------------------------- CLI


def _select(cfg, keys: list[str]) -> str:

    chunks = []
    for key in keys:
        value = OmegaConf.select(cfg, key, default="<absent>", throw_on_missing=False)
        if OmegaConf.is_config(value):
            body = OmegaConf.to_yaml(value, resolve=True).rstrip()
            chunks.append(f"{key}:\n" + "\n".join("  " + line for line in body.splitlines()))
        else:
            chunks.append(f"{key}: {value}")
    return "\n".join(chunks)


# --------------------------------------------------------------------------- the command (its options: dryrun_args)


def main(argv: list[str] | None = None) -> int:
    """`slimckpt dryrun` without the plan's options (slimckpt.plan.dryrun_cli has them)."""
    args, overrides = parse(build_parser(), argv)
    return run_parsed(args, overrides)


def run_parsed(
    args: argparse.Namespace, overrides: list[str], after: Callable[[argparse.Namespace, list[str]], int] | None = None
) -> int:
    """The dry run of parsed options; `after(args, overrides)` runs once the config passed and
    returns the exit status."""
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
        try:
            if args.show:
                print(_select(cfg, [k.strip() for k in args.show.split(",") if k.strip()]))
            else:
                print(OmegaConf.to_yaml(cfg, resolve=not args.unresolved), end="")
        except Exception as e:  # a broken interpolation shows up while printing resolved values
            _fail(DryRunError(f"cannot resolve the config: {one_line(str(e).split('    full_key')[0])}"))
            return 1
        sys.stdout.flush()

    if args.no_validate:
        print("config composed (not validated)")
        return 0
    try:
        from slimckpt.verl.dryrun_checks import validate

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
