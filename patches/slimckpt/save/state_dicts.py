"""The incremental tier's state dicts: what a save writes and a load reads into, keyed by parameter name.

{"model": ..., "optim": ...} from torch's distributed state_dict API, sharded, on the tensors' own
device (DCP copies each to host only while writing it); tied weights written once (split_aliases);
verl's save_lora_only kept as verl keeps it (lora_only_state).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from slimckpt.layout.names import is_lora_key
from slimckpt.log import get_logger
from slimckpt.save import optim_capture
from slimckpt.save.modes.writer import state_bytes
from slimckpt.save.target import SaveTarget

log = get_logger("slimckpt.resume")

LORA_ONLY_KEY = "lora_only"  # manifest.extra: the step holds the adapter's parameters, not the base's


def options() -> StateDictOptions:
    # sharded, on the tensors' own device: DCP copies each to host only while writing it
    return StateDictOptions(full_state_dict=False, cpu_offload=False)


def load_options(partial: bool) -> StateDictOptions:
    """Load options; `partial` (a LoRA-only step): the base weights the step does not hold are kept."""
    return StateDictOptions(full_state_dict=False, cpu_offload=False, strict=not partial)


def build_state_dict(target: Any, model: bool, optimizer: bool, optimizer_state: bool | None = None) -> dict[str, Any]:
    """{"model": ..., "optim": ...} keyed by parameter name, of `target.model` and `target.optimizer`
    (a SaveTarget, or anything holding the two); FSDP2 gives views of the live shards
    (no copy). FSDP1 builds its sharded state dict on the device. The optimizer's part is taken
    as it is (optim_capture: a save before the first step changes nothing); for a load,
    `optimizer_state` says whether the step holds per-parameter optimizer state to read into."""
    state: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model:
            state["model"] = get_model_state_dict(target.model, options=options())
    if optimizer and optimizer_state is None:
        state["optim"] = optim_capture.capture(target.model, target.optimizer, options())
    elif optimizer:
        state["optim"] = optim_capture.load_template(target.model, target.optimizer, options(), optimizer_state)
    return state


def _view_key(t: Any) -> tuple | None:
    local = t.to_local() if hasattr(t, "to_local") else t
    if not isinstance(local, torch.Tensor) or local.device.type == "meta" or local.numel() == 0:
        return None
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.stride(), local.dtype)


def split_aliases(model_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Drop keys that view the same memory as an earlier key (tied embeddings: lm_head.weight is
    embed_tokens.weight). DCP would write such a tensor once per name; it is written once and the
    alias is recorded in the manifest."""
    first: dict[tuple, str] = {}
    kept: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for name, value in model_state.items():
        key = _view_key(value)
        if key is not None and key in first:
            aliases[name] = first[key]
            continue
        if key is not None:
            first[key] = name
        kept[name] = value
    return kept, aliases


# --------------------------------------------------------------------------- save_lora_only


def lora_only_state(model_state: dict[str, Any]) -> dict[str, Any]:
    """The trainable LoRA parameters of a sharded model state dict, as verl's save_lora_only keeps
    them; verl's error when there are none."""
    kept = {k: v for k, v in model_state.items() if is_lora_key(k)}
    if not kept:
        raise ValueError(
            f"save_lora_only is True and the model has a peft_config, but no LoRA/adapter parameters "
            f"were found in the state dict. Total params checked: {len(model_state)}."
        )
    return kept


def note_lora_only(target: SaveTarget, model_state: dict[str, Any], total: int) -> None:
    if target.rank != 0 or not target.state.note_once("lora_only"):
        return
    log.info(
        "save_lora_only: the resume state holds the %d LoRA parameters of %d (%.1f MiB on rank 0) and their "
        "optimizer state; a resume takes the base weights from actor_rollout_ref.model.path, as verl's does",
        len(model_state),
        total,
        state_bytes(model_state) / 2**20,
    )


def note_fsdp1_copy(target: SaveTarget, state: dict[str, Any]) -> None:
    """Say once what FSDP1 costs here: its sharded state dicts are new tensors (model rows
    re-chunked, optimizer state cut out of the flat parameters), all alive during the write."""
    if not target.state.note_once("fsdp1_copy"):
        return
    if target.fsdp_version == 1 and target.rank == 0:
        log.warning(
            "FSDP1: the reshardable state dict is a %.1f MiB copy of this rank's shards on %s while "
            "it is written (strategy=fsdp2 saves without a copy)",
            state_bytes(state) / 2**20,
            next(iter(target.model.parameters())).device.type,
        )


__all__ = [
    "LORA_ONLY_KEY",
    "build_state_dict",
    "is_lora_key",
    "load_options",
    "lora_only_state",
    "note_fsdp1_copy",
    "note_lora_only",
    "options",
    "split_aliases",
]
