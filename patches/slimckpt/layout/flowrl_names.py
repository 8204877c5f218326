"""The one rule for FlowRL's own parameters: they live under the actor module's `flowrl_log_z`
attribute, so every name that has `flowrl_log_z` as a dotted component is FlowRL's.

The log-partition head Z_phi is trained and checkpointed with the actor (it is part of the actor
module's state dict, so verl's checkpoint manager saves and loads it), but it is not part of the
language model: Hugging Face exports (verl's hf_model save, verl's model merger, `slimckpt merge`)
and the weights pushed to the rollout engine must leave it out. They all ask this predicate.
Works on any prefix verl or FSDP adds (`_fsdp_wrapped_module.`, `model.`, `base_model.model.`).
"""

from __future__ import annotations

LOG_Z_ATTR = "flowrl_log_z"


def is_flowrl_param(name: str) -> bool:
    """True for a state-dict / parameter name that belongs to FlowRL's log Z head."""
    return LOG_Z_ATTR in name.split(".")
