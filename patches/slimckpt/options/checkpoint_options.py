"""CheckpointOptions: the settings of slimckpt's checkpoint engine, each typed and documented once.

The engine (save/, plan/, observe/) reads these and nothing of verl's. A recipe's verl config class,
`slimckpt.verl.checkpoint_config.SlimCheckpointConfig`, is verl's CheckpointConfig with these
fields added, so YAML spells them under `checkpoint:`; a caller without verl (the GPU check, a
test, another trainer) builds CheckpointOptions directly. Values arrive as YAML parsed them and are
normalised here ("true" -> True, "64" -> 64, async_save true -> "pool").
"""

from __future__ import annotations

import difflib
import functools
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal, get_args, get_origin

Recipe = Literal["quickstart", "intermediate", "incremental"]
# async_save as the config holds it; YAML/CLI spell it false | true (= pool) | pool | stream
AsyncSave = Literal["off", "pool", "stream"]
ExportDtype = Literal["auto", "bf16", "fp16", "fp32"]
OnSaveError = Literal["stop", "continue"]
BestMode = Literal["max", "min"]
RECIPES: tuple[str, ...] = get_args(Recipe)
# the spellings async_save takes from YAML or the command line, as its error line names them
ASYNC_WORDS = {"false": "off", "off": "off", "true": "pool", "pool": "pool", "stream": "stream"}


def _bad_value(key: str, value, allowed: str) -> ValueError:
    return ValueError(f"checkpoint.{key}={value!r} ({type(value).__name__}) is not allowed; use {allowed}")


# Hydra's instantiate (verl builds a `_target_` config with it) passes each value as YAML parsed it,
# unchecked: `async_save=stream` arrives as the string "stream", and a non-empty string is true.
# `true`/`false` arrive as bools; the strings "true"/"false" (an `${oc.env:...}` interpolation) and
# integer strings are taken too, as OmegaConf takes them for a typed field. Each checker below takes
# what YAML may give for one field type and returns the value as the field holds it.


def _as_bool(key: str, value):
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _bad_value(key, value, "true or false")


def _as_async(key: str, value) -> str:
    word = str(value).strip().lower() if isinstance(value, (bool, str)) else None
    if word not in ASYNC_WORDS:
        raise _bad_value(key, value, "false, true (= pool), pool or stream")
    return ASYNC_WORDS[word]


def _as_int(key: str, value, optional: bool = False):
    # optional: null (none/"null" from an interpolation) for "every kept step"
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~", ""))):
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise _bad_value(key, value, "a whole number, e.g. 64")


def _as_gib(key: str, value):
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"  # resolved on the rank that saves (slimckpt.save.host_budget)
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            pass
    if number is None or not math.isfinite(number):
        raise _bad_value(key, value, "a number of GiB, e.g. 16, or auto")
    return number


def _as_choice(key: str, value, allowed: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in allowed:
        return value
    hint = difflib.get_close_matches(str(value), allowed, 1)
    what = "a slimckpt recipe" if key == "recipe" else "allowed"
    raise ValueError(
        f"checkpoint.{key}={value!r} is not {what}; use one of {', '.join(allowed)}"
        + (f" (did you mean {hint[0]!r}?)" if hint else "")
    )


def _checker(hint) -> tuple[int, typing.Callable | None]:
    """(order, check) for a field's declared type: the order in which a config's fields are checked
    (booleans first, choices last), and the function that takes YAML's value for it (None: unchecked)."""
    if hint == AsyncSave:
        return 0, _as_async
    if hint is bool:
        return 1, _as_bool
    if hint is int:
        return 2, _as_int
    args = get_args(hint)
    if set(args) == {int, type(None)}:
        return 3, functools.partial(_as_int, optional=True)
    if float in args and Literal["auto"] in args:
        return 4, _as_gib
    if get_origin(hint) is Literal:
        return 5, functools.partial(_as_choice, allowed=args)
    return 9, None


@dataclass
class CheckpointOptions:
    """slimckpt's checkpoint settings; each field's type is the one place its allowed values are
    declared (YAML's spellings are taken at construction)."""

    recipe: Recipe = "quickstart"
    """Which tier set this config (quickstart | intermediate | incremental)."""
    measure: bool = True
    """Record peak anonymous RSS, bytes and seconds of every save (per rank, JSON next to the
    checkpoint and a log line)."""
    export_hf: bool = False
    """After each save, write `huggingface/` safetensors with bounded memory instead of verl's
    `hf_model` gather: intermediate tier from the freshly written shards (streaming merge);
    incremental tier straight from each rank's shards (hf_direct_export; an `hf_model` in
    save_contents is then skipped, with a log line)."""
    export_dtype: ExportDtype = "bf16"
    """Dtype of the export (auto | bf16 | fp16 | fp32). auto (incremental tier only): the
    parameters' own dtype, what verl's hf_model save writes (fp32 master weights -> fp32); bf16 is
    what verl's model_merger writes."""
    max_shard_size: str = "5GB"
    """Largest safetensors file of the export, as Hugging Face's ("5GB")."""
    incremental_save: bool = False
    """Write resume state (model, optimizer, extra) as a reshardable DCP checkpoint, streamed tensor
    by tensor (slimckpt.save.resume_state), committed by a manifest."""
    bucket_mb: int = 64
    """Host bytes (MiB) a streaming save may copy ahead from the accelerator per write thread; a
    save's extra host memory is about write_threads x (bucket_mb + largest tensor)."""
    write_threads: int = 1
    """File-writing threads per rank (DCP FileSystemWriter thread_count)."""
    async_save: AsyncSave = "off"
    """false | true (= pool) | pool | stream in YAML, held as off | pool | stream (incremental tier
    only). pool: the save copies the rank's shards into a host staging pool held for the run and
    writes it in the background. stream: no copy at the save; the background writer reads the live
    shards while the rollout runs, and the next change to them (optimizer step, offload, LoRA merge
    for weight sync, a load) first copies what is still unread into host memory within
    host_memory_budget_gb, or waits for the writer (slimckpt.save.modes.stream_capture)."""
    host_memory_budget_gb: float | Literal["auto"] = 16.0
    """With async_save, the most host memory (GiB) a rank may hold staged state in; pool: a rank
    whose state is larger saves synchronously (streaming) and logs it; stream: the most a mutation
    guard copies, it waits for the writer for the rest. auto (the incremental recipe's): half of the
    node's available memory over its local ranks, resolved by each rank at its first save and
    logged once per node (slimckpt.save.host_budget); a number always wins."""
    verify: bool = True
    """The incremental tier always records size and xxh3_128 of every file of a step at save; with
    verify (default) a load checks both (the ranks share the hashing: about a quarter of a CPU
    load's time), without it sizes only, so a bit flip could load silently. `slimckpt verify <dir>`
    runs the full check offline either way."""
    save_lora_only: bool = False
    """verl's: a peft actor's save keeps only the LoRA adapter's parameters."""
    on_save_error: OnSaveError = "stop"
    """What a failed save (disk full, unwritable dir, another writer) does: stop (raise, the
    default) or continue (log it at ERROR, mark the step failed, keep the tracker on the last
    committed step, train on). See slimckpt.save.errors."""
    allow_verl_fallback: bool = True
    """The intermediate tier's export of a model its streaming merge does not handle (a save-time
    conversion that is not a slice of one tensor) runs verl's own merger on rank 0, which holds the
    whole model in host memory (logged with how much); false refuses instead: the save fails on
    every rank in one line (then on_save_error applies). MoE experts and LoRA actors are streamed
    either way."""
    export_merge_lora: bool = False
    """A LoRA actor's export (export_hf) is by default what verl's merger writes: the base model,
    and `huggingface/lora_adapter/` with the adapter and adapter_config.json; true writes the base
    weights with the adapter merged in (W + B @ A x alpha / r, as peft's merge_and_unload() and
    `slimckpt merge --merge_lora`) and no lora_adapter/. No effect without LoRA."""
    trust_pickle: bool = False
    """A resume unpickles only the globals verl and torch write (tensors, DTensor and ShardedTensor
    metadata, containers, dtypes, RNG and lr-scheduler state, DCP's metadata:
    slimckpt.engine.pickle_policy); a checkpoint naming any other is refused before it runs, in one
    line naming the file and the global. true unpickles anything, as verl's own load
    (torch.load(weights_only=False)): only for checkpoints from someone you trust."""
    allow_fsdp1_device_copy: bool = False
    """An incremental save on FSDP1 (strategy=fsdp) copies the rank's model and optimizer shards on
    the GPU while it writes them (FSDP2 saves from views). At start-up the driver compares that peak
    with the GPU's memory (slimckpt.save.device_budget) and stops a run it does not fit, naming
    strategy=fsdp2; true starts it anyway."""
    keep_optimizer_last: int | None = None
    """Of the steps retention keeps (trainer.max_*_ckpt_to_keep, keep_best), only the newest N keep
    their optimizer state; older ones keep model, extra state and the HF export (null, the default:
    every kept step keeps it). The tracker's step always keeps it. A step without it resumes
    model-only, saying so. See docs/retention.md."""
    keep_best: int = 0
    """Also keep the keep_best steps with the best value (best_mode) of best_metric; 0 (default)
    keeps none for it."""
    best_metric: str | None = None
    """A metric the trainer logs at save steps, ranked for keep_best (its value is recorded next to
    the step, slimckpt_metrics.json)."""
    best_mode: BestMode = "max"
    """Whether the best value of best_metric is the largest (max) or the smallest (min)."""

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        self.normalise_options()
        self.check_option_rules()

    def normalise_options(self) -> None:
        """Take YAML's spellings ("true" -> True, "64" -> 64); a value no spelling fits fails in one line."""
        for key, check in _CHECKS:
            # verl's BaseConfig freezes set fields; this only normalises "true" -> True, "64" -> 64
            object.__setattr__(self, key, check(key, getattr(self, key)))

    def check_option_rules(self) -> None:
        """Refuse settings that cannot be carried out together, in one line each."""
        if self.export_dtype == "auto" and not self.incremental_save:
            raise ValueError(
                "checkpoint.export_dtype=auto (the parameters' dtype) needs incremental_save=true; "
                "the intermediate tier's export takes bf16, fp16 or fp32"
            )
        if self.async_save != "off" and not self.incremental_save:
            raise ValueError(
                f"checkpoint.async_save={'stream' if self.async_save == 'stream' else 'true'} needs checkpoint.incremental_save=true: verl's FSDP manager has no "
                "async save and its trainer then never writes latest_checkpointed_iteration.txt (verl #7952)"
            )
        budget_given = not isinstance(self.host_memory_budget_gb, str)
        if self.bucket_mb < 1 or self.write_threads < 1 or (budget_given and self.host_memory_budget_gb < 0):
            raise ValueError(
                f"checkpoint.bucket_mb={self.bucket_mb}, write_threads={self.write_threads}, "
                f"host_memory_budget_gb={self.host_memory_budget_gb}: use bucket_mb>=1, write_threads>=1, budget>=0"
            )
        check_retention(self.keep_optimizer_last, self.keep_best, self.best_metric, self.best_mode)


def _field_checks(cls) -> list[tuple[str, typing.Callable]]:
    hints = typing.get_type_hints(cls)
    found = [(_checker(hints[f.name]), f.name) for f in fields(cls)]
    return [(name, check) for (order, check), name in sorted(found, key=lambda x: x[0][0]) if check is not None]


_CHECKS = _field_checks(CheckpointOptions)
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(CheckpointOptions))


def check_retention(keep_optimizer_last: int | None, keep_best: int, best_metric: str | None, best_mode: str) -> None:
    """One-line ValueError for retention settings that cannot be carried out (docs/retention.md)."""
    if keep_optimizer_last is not None and keep_optimizer_last < 1:
        raise ValueError(
            f"checkpoint.keep_optimizer_last={keep_optimizer_last}: use a whole number >= 1 (the newest "
            f"step always keeps its optimizer state), or null to keep it in every step"
        )
    if keep_best < 0:
        raise ValueError(f"checkpoint.keep_best={keep_best}: use 0 (off) or a whole number of steps")
    if keep_best and not best_metric:
        raise ValueError(
            "checkpoint.keep_best needs checkpoint.best_metric: the name of a metric the trainer logs at "
            "save steps, e.g. best_metric=critic/score/mean"
        )
    if best_mode not in ("max", "min"):
        raise ValueError(f"checkpoint.best_mode={best_mode!r}: use max or min")


def async_mode(value) -> str:
    """ "off", "pool" or "stream" for an async_save value as a config holds it (a checked
    field, or the raw YAML value verl's trainer reads)."""
    try:
        return _as_async("async_save", False if value is None else value)
    except ValueError:
        return "off"


__all__ = [
    "ASYNC_WORDS",
    "RECIPES",
    "ROLE_KEYS",
    "ROLE_SECTIONS",
    "AsyncSave",
    "BestMode",
    "CheckpointOptions",
    "ExportDtype",
    "OPTION_NAMES",
    "OnSaveError",
    "Recipe",
    "async_mode",
    "check_retention",
    "options_of",
    "role_options",
    "roles_in_use",
]


# The `_target_` a recipe's checkpoint section names (the verl wing's SlimCheckpointConfig, by path:
# this wing does not import verl's).
SLIM_TARGETS = ("slimckpt.verl.checkpoint_config.SlimCheckpointConfig",)


def options_of(section: typing.Any) -> CheckpointOptions | None:
    """The settings a checkpoint section holds, read as SlimCheckpointConfig reads them (the same
    defaults, spellings and refusals), or None where the section is verl's own (no recipe).

    `section` is what verl's driver holds (a DictConfig, or a plain mapping) or the built config
    itself; the driver-side patches read a role's settings through here only."""
    if section is None:
        return None
    if isinstance(section, CheckpointOptions):
        return section
    if section.get("_target_") not in SLIM_TARGETS:
        return None
    names = {f.name for f in fields(CheckpointOptions)}
    return CheckpointOptions(**{key: section[key] for key in section.keys() if key in names})


# where verl's trainer config holds each role's checkpoint section: the path of keys, and the dotted key
# OmegaConf.select and a command-line override take
ROLE_SECTIONS = {"actor": ("actor_rollout_ref", "actor", "checkpoint"), "critic": ("critic", "checkpoint")}
ROLE_KEYS = {role: ".".join(path) for role, path in ROLE_SECTIONS.items()}


def roles_in_use(use_critic: bool) -> tuple[str, ...]:
    """The roles whose checkpoint sections a run reads: the actor's, and the critic's when it has one."""
    return tuple(role for role in ROLE_SECTIONS if use_critic or role == "actor")


def role_options(config: Mapping, role: str) -> CheckpointOptions | None:
    """The settings of `role`'s ("actor" or "critic") checkpoint section in verl's trainer config, as
    `options_of` reads them; None where the config has no such section or it is verl's own.

    `config` is the trainer's (a DictConfig) or the plain dict verl's `Tracking` is built with: one
    walk for both, so every driver-side patch finds a role's section the same way."""
    node: typing.Any = config
    for key in ROLE_SECTIONS[role]:
        node = node.get(key) if isinstance(node, Mapping) else None
    return options_of(node) if isinstance(node, Mapping) else None
