"""SlimCheckpointConfig: verl's CheckpointConfig plus the fields slimckpt's recipes set.

A recipe points `actor_rollout_ref.actor.checkpoint._target_` (and the critic's) here. verl
builds this dataclass in the driver and in every worker, and that is the only sign a worker gets
that a recipe is in use: a valid config switches the "checkpoint" feature on in that process
(`features.switch_on`, which has the registry apply the feature's patches). Without a recipe it is
never built and verl runs unpatched.
"""

from __future__ import annotations

import difflib
import functools
import math
from dataclasses import dataclass, fields

from verl.trainer.config.config import CheckpointConfig

RECIPES = ("quickstart", "intermediate", "incremental")
# Every field slimckpt sets or reads, by the type it must have. Hydra's instantiate (verl builds a
# `_target_` config with it) passes each value as YAML parsed it, unchecked: `async_save=stream`
# arrives as the string "stream", and a non-empty string is true. `true`/`false` arrive as bools;
# the strings "true"/"false" (an `${oc.env:...}` interpolation) and integer strings are taken too,
# as OmegaConf takes them for a typed field.
BOOL_FIELDS = ("measure", "export_hf", "incremental_save", "verify", "save_lora_only",
               "allow_verl_fallback", "export_merge_lora", "trust_pickle")
# async_save: false | true | pool | stream. true is pool (what it meant before stream existed); the
# field keeps False / True / "stream", so every `if config.async_save` reads as before.
ASYNC_MODES = ("false", "true", "pool", "stream")
INT_FIELDS = ("bucket_mb", "write_threads", "keep_best")
# a whole number, or null (none/"null" from an interpolation) for "every kept step"
OPTIONAL_INT_FIELDS = ("keep_optimizer_last",)
FLOAT_FIELDS = ("host_memory_budget_gb",)
ENUM_FIELDS = {
    "recipe": RECIPES,
    "export_dtype": ("auto", "bf16", "fp16", "fp32"),
    "on_save_error": ("stop", "continue"),
    "best_mode": ("max", "min"),
}


def _bad_value(key: str, value, allowed: str) -> ValueError:
    return ValueError(f"checkpoint.{key}={value!r} ({type(value).__name__}) is not allowed; use {allowed}")


def _checked(key: str, value):
    """`value` as the type `key` must have, or a one-line ValueError naming the key, the value
    and the allowed values."""
    if key in BOOL_FIELDS:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise _bad_value(key, value, "true or false")
    if key == "async_save":
        word = str(value).strip().lower() if isinstance(value, (bool, str)) else None
        if word not in ASYNC_MODES:
            raise _bad_value(key, value, "false, true (= pool), pool or stream")
        return "stream" if word == "stream" else word in ("true", "pool")
    if key in OPTIONAL_INT_FIELDS:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~", "")):
            return None
    if key in INT_FIELDS or key in OPTIONAL_INT_FIELDS:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise _bad_value(key, value, "a whole number, e.g. 64")
    if key in FLOAT_FIELDS:
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
    allowed = ENUM_FIELDS[key]
    if isinstance(value, str) and value in allowed:
        return value
    hint = difflib.get_close_matches(str(value), allowed, 1)
    what = "a slimckpt recipe" if key == "recipe" else "allowed"
    raise ValueError(f"checkpoint.{key}={value!r} is not {what}; use one of {', '.join(allowed)}"
                     + (f" (did you mean {hint[0]!r}?)" if hint else ""))


@dataclass
class SlimCheckpointConfig(CheckpointConfig):
    """Fields (beyond verl's save_contents, load_contents, async_save, strict, save_lora_only):

    recipe: which tier set this config (quickstart | intermediate | incremental).
    measure: record peak anonymous RSS, bytes and seconds of every save (per rank, JSON next to
        the checkpoint and a log line).
    export_hf: after each save, write `huggingface/` safetensors with bounded memory instead of
        verl's `hf_model` gather: intermediate tier from the freshly written shards (streaming
        merge); incremental tier straight from each rank's shards (hf_direct_export; an
        `hf_model` in save_contents is then skipped, with a log line).
    export_dtype: dtype of the export (auto | bf16 | fp16 | fp32). auto (incremental tier only):
        the parameters' own dtype, what verl's hf_model save writes (fp32 master weights -> fp32);
        bf16 is what verl's model_merger writes.
    max_shard_size: largest safetensors file of the export, as Hugging Face's ("5GB").
    allow_verl_fallback: the intermediate tier's export of a model its streaming merge does not
        handle (a save-time conversion that is not a slice of one tensor) runs verl's own merger on
        rank 0, which holds the whole model in host memory (logged with how much); false refuses
        instead: the save fails on every rank in one line (then on_save_error applies). MoE experts
        and LoRA actors are streamed either way.
    export_merge_lora: a LoRA actor's export (export_hf) is by default what verl's merger writes:
        the base model, and `huggingface/lora_adapter/` with the adapter and adapter_config.json;
        true writes the base weights with the adapter merged in (W + B @ A x alpha / r, as peft's
        merge_and_unload() and `slimckpt merge --merge_lora`) and no lora_adapter/. No effect
        without LoRA.
    incremental_save: write resume state (model, optimizer, extra) as a reshardable DCP
        checkpoint, streamed tensor by tensor (slimckpt.save.resume_state), committed by a manifest.
    bucket_mb: host bytes (MiB) a streaming save may copy ahead from the accelerator per write
        thread; a save's extra host memory is about write_threads x (bucket_mb + largest tensor).
    write_threads: file-writing threads per rank (DCP FileSystemWriter thread_count).
    async_save: false | true (= pool) | pool | stream (incremental tier only). pool: the save
        copies the rank's shards into a host staging pool held for the run and writes it in the
        background. stream: no copy at the save; the background writer reads the live shards
        while the rollout runs, and the next change to them (optimizer step, offload, LoRA merge
        for weight sync, a load) first copies what is still unread into host memory within
        host_memory_budget_gb, or waits for the writer (slimckpt.save.stream_capture).
    host_memory_budget_gb: with async_save, the most host memory (GiB) a rank may hold staged
        state in; pool: a rank whose state is larger saves synchronously (streaming) and logs it;
        stream: the most a mutation guard copies, it waits for the writer for the rest.
        auto (the incremental recipe's): half of the node's available memory over its local
        ranks, resolved by each rank at its first save and logged once per node
        (slimckpt.save.host_budget); a number always wins.
    verify: the incremental tier always records size and xxh3_128 of every file of a step at
        save; with verify (default) a load checks both (the ranks share the hashing: about a
        quarter of a CPU load's time), without it sizes only, so a bit flip could load silently.
        `slimckpt verify <dir>` runs the full check offline either way.
    trust_pickle: a resume unpickles only the globals verl and torch write (tensors, DTensor and
        ShardedTensor metadata, containers, dtypes, RNG and lr-scheduler state, DCP's metadata:
        slimckpt.read.pickle_policy); a checkpoint naming any other is refused before it runs, in
        one line naming the file and the global. true unpickles anything, as verl's own load
        (torch.load(weights_only=False)): only for checkpoints from someone you trust.
    on_save_error: what a failed save (disk full, unwritable dir, another writer) does: stop
        (raise, the default) or continue (log it at ERROR, mark the step failed, keep the tracker
        on the last committed step, train on). See slimckpt.save.errors.
    keep_optimizer_last: of the steps retention keeps (trainer.max_*_ckpt_to_keep, keep_best),
        only the newest N keep their optimizer state; older ones keep model, extra state and the
        HF export (null, the default: every kept step keeps it). The tracker's step always keeps
        it. A step without it resumes model-only, saying so. See docs/retention.md.
    keep_best / best_metric / best_mode: also keep the keep_best steps with the best value
        (max or min) of best_metric, a metric the trainer logs at save steps (its value is
        recorded next to the step, slimckpt_metrics.json); 0 (default) keeps none for it.
    """

    recipe: str = "quickstart"
    measure: bool = True
    export_hf: bool = False
    export_dtype: str = "bf16"
    max_shard_size: str = "5GB"
    incremental_save: bool = False
    bucket_mb: int = 64
    write_threads: int = 1
    host_memory_budget_gb: float | str = 16.0
    verify: bool = True
    on_save_error: str = "stop"
    allow_verl_fallback: bool = True
    export_merge_lora: bool = False
    trust_pickle: bool = False
    keep_optimizer_last: int | None = None
    keep_best: int = 0
    best_metric: str | None = None
    best_mode: str = "max"

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        from .features import switch_on
        from .registry import check_verl_version

        check_verl_version()
        present = {f.name for f in fields(self)}
        for key in ("async_save", *BOOL_FIELDS, *INT_FIELDS, *OPTIONAL_INT_FIELDS, *FLOAT_FIELDS, *ENUM_FIELDS):
            if key in present:
                # verl's BaseConfig freezes set fields; this only normalises "true" -> True, "64" -> 64
                object.__setattr__(self, key, _checked(key, getattr(self, key)))
        if "hf_model" in self.save_contents and self.export_hf and not self.incremental_save:
            raise ValueError(
                "checkpoint.save_contents has 'hf_model' and export_hf=true: both would write huggingface/; "
                "drop 'hf_model' (export_hf replaces verl's gather)"
            )
        if self.export_hf and "model" not in self.save_contents:
            raise ValueError("checkpoint.export_hf=true exports from the saved model shards: keep 'model' in "
                             "checkpoint.save_contents")
        if self.export_dtype == "auto" and not self.incremental_save:
            raise ValueError("checkpoint.export_dtype=auto (the parameters' dtype) needs incremental_save=true; "
                             "the intermediate tier's export takes bf16, fp16 or fp32")
        if self.async_save and not self.incremental_save:
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
        switch_on("checkpoint")


def check_retention(keep_optimizer_last: int | None, keep_best: int, best_metric: str | None, best_mode: str) -> None:
    """One-line ValueError for retention settings that cannot be carried out (docs/retention.md)."""
    if keep_optimizer_last is not None and keep_optimizer_last < 1:
        raise ValueError(f"checkpoint.keep_optimizer_last={keep_optimizer_last}: use a whole number >= 1 (the newest "
                         f"step always keeps its optimizer state), or null to keep it in every step")
    if keep_best < 0:
        raise ValueError(f"checkpoint.keep_best={keep_best}: use 0 (off) or a whole number of steps")
    if keep_best and not best_metric:
        raise ValueError("checkpoint.keep_best needs checkpoint.best_metric: the name of a metric the trainer logs at "
                         "save steps, e.g. best_metric=critic/score/mean")
    if best_mode not in ("max", "min"):
        raise ValueError(f"checkpoint.best_mode={best_mode!r}: use max or min")


def _reject_unknown_fields(cls):
    """A misspelled key under `checkpoint:` fails naming the key, a close match and the valid ones
    (the dataclass's own TypeError names only the key)."""
    generated = cls.__init__

    @functools.wraps(generated)
    def __init__(self, *args, **kwargs):
        valid = [f.name for f in fields(cls) if f.init and not f.name.startswith("_")]
        unknown = sorted(k for k in kwargs if k not in valid and not k.startswith("_"))
        if unknown:
            hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, valid, 1)) else repr(k)
                     for k in unknown]
            raise TypeError(
                f"checkpoint: unknown field {', '.join(hints)} for slimckpt.verl.checkpoint_config.SlimCheckpointConfig; "
                f"valid fields: {', '.join(valid)}"
            )
        generated(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


_reject_unknown_fields(SlimCheckpointConfig)


def async_mode(value) -> str:
    """"off", "pool" or "stream" for an async_save value as a config holds it (a checked
    SlimCheckpointConfig field, or the raw YAML value verl's trainer reads)."""
    try:
        checked = _checked("async_save", False if value is None else value)
    except ValueError:
        return "off"
    return "stream" if checked == "stream" else ("pool" if checked else "off")
