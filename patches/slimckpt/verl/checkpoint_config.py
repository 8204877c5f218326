"""SlimCheckpointConfig: verl's CheckpointConfig plus the fields slimckpt's recipes set.

A recipe points `actor_rollout_ref.actor.checkpoint._target_` (and the critic's) here. verl
builds this dataclass in the driver and in every worker, and that is the only sign a worker gets
that a recipe is in use: a valid config switches the "checkpoint" feature on in that process
(`features.switch_on`, which has the registry apply the feature's patches). Without a recipe it is
never built and verl runs unpatched.
"""

from __future__ import annotations

import contextvars
import difflib
import functools
from dataclasses import dataclass, fields

from verl.trainer.config.config import CheckpointConfig

from slimckpt.options.checkpoint_options import CheckpointOptions
from slimckpt.verl import features
from slimckpt.verl_files import version

# a defaults-only config (state of a manager whose config is verl's own) switches nothing on
_DEFAULTS_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("slimckpt_defaults_only", default=False)


@dataclass
class SlimCheckpointConfig(CheckpointOptions, CheckpointConfig):
    """verl's CheckpointConfig plus slimckpt's CheckpointOptions (slimckpt.options.checkpoint_options:
    each field typed and documented there once). Two of verl's fields are redeclared there:
    async_save (off | pool | stream) and save_lora_only."""

    @classmethod
    def defaults(cls) -> SlimCheckpointConfig:
        """The fields' defaults, for a manager whose config is verl's own: checks nothing against
        the installed verl and switches no feature on (no recipe asked for it)."""
        token = _DEFAULTS_ONLY.set(True)
        try:
            return cls()
        finally:
            _DEFAULTS_ONLY.reset(token)

    def __post_init__(self) -> None:
        parent = getattr(CheckpointConfig, "__post_init__", None)
        if parent is not None:
            parent(self)
        if not _DEFAULTS_ONLY.get():
            version.check_verl_version()
        self.normalise_options()
        if "hf_model" in self.save_contents and self.export_hf and not self.incremental_save:
            raise ValueError(
                "checkpoint.save_contents has 'hf_model' and export_hf=true: both would write huggingface/; "
                "drop 'hf_model' (export_hf replaces verl's gather)"
            )
        if self.export_hf and "model" not in self.save_contents:
            raise ValueError(
                "checkpoint.export_hf=true exports from the saved model shards: keep 'model' in "
                "checkpoint.save_contents"
            )
        self.check_option_rules()
        if not _DEFAULTS_ONLY.get():
            features.switch_on("checkpoint")


def _reject_unknown_fields(cls):
    """A misspelled key under `checkpoint:` fails naming the key, a close match and the valid ones
    (the dataclass's own TypeError names only the key)."""
    generated = cls.__init__

    @functools.wraps(generated)
    def __init__(self, *args, **kwargs):
        valid = [f.name for f in fields(cls) if f.init and not f.name.startswith("_")]
        unknown = sorted(k for k in kwargs if k not in valid and not k.startswith("_"))
        if unknown:
            hints = [
                f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, valid, 1)) else repr(k)
                for k in unknown
            ]
            raise TypeError(
                f"checkpoint: unknown field {', '.join(hints)} for slimckpt.verl.checkpoint_config.SlimCheckpointConfig; "
                f"valid fields: {', '.join(valid)}"
            )
        generated(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


_reject_unknown_fields(SlimCheckpointConfig)
