"""verl's FSDPCheckpointManager as the engine's SaveTarget: the one place a save or load reads the manager.

Built at each save and load (cheap: references, no copies). Its `state` is the manager's TargetState
(manager_state), kept on the manager for the run; its `saved_paths` is verl's own
`previous_saved_paths` list, which retention updates in place; `side_files` runs verl's own save for
what the engine does not write itself (huggingface/ configs and tokenizer, fsdp_config.json, LoRA
meta, an hf_model gather), with verl's contents narrowed to those.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from verl.utils.fsdp_utils import fsdp_version

from ..save.target import SaveTarget
from .manager_state import config_of, state_of


@contextlib.contextmanager
def _narrowed(manager: Any, attr: str, contents: list[str]) -> Iterator[None]:
    kept = getattr(manager, attr)
    setattr(manager, attr, list(contents))
    try:
        yield
    finally:
        setattr(manager, attr, kept)


def load_contents(manager: Any, contents: list[str]) -> contextlib.AbstractContextManager[None]:
    """Run verl's load with only `contents` (its should_load_* read this list)."""
    return _narrowed(manager, "checkpoint_load_contents", contents)


def save_contents(manager: Any, contents: list[str]) -> contextlib.AbstractContextManager[None]:
    """Run verl's save with only `contents` (its should_save_* read this list)."""
    return _narrowed(manager, "checkpoint_save_contents", contents)


def _verl_side_files(manager: Any, original: Callable, hdfs_path: str | None, step: int) -> Callable:
    def side_files(local_path: str, contents: list[str]) -> None:
        # verl's own save for huggingface/, fsdp_config.json, LoRA meta and hf_model; it retains nothing
        with save_contents(manager, contents):
            original(manager, local_path, hdfs_path, step, None)

    return side_files


def target_of(
    manager: Any, original: Callable | None = None, hdfs_path: str | None = None, step: int = 0
) -> SaveTarget:
    """The manager as a SaveTarget; `original` (verl's unpatched save_checkpoint) writes its side files."""
    lora_only = bool(manager.should_save_lora_only and manager._has_lora())
    return SaveTarget(
        model=manager.model,
        optimizer=manager.optimizer,
        options=config_of(manager),
        state=state_of(manager),
        rank=int(manager.rank),
        world_size=int(manager.world_size),
        lr_scheduler=manager.lr_scheduler,
        save_contents=tuple(manager.checkpoint_save_contents),
        load_contents=tuple(manager.checkpoint_load_contents),
        fsdp_version=int(fsdp_version(manager.model)),
        get_rng_state=manager.get_rng_state,
        load_rng_state=manager.load_rng_state,
        lora_only=lora_only,
        lora_train_meta=getattr(manager, "_get_lora_train_meta", None),
        trust_remote_code=bool(getattr(manager, "trust_remote_code", False)),
        saved_paths=manager.previous_saved_paths,
        side_files=_verl_side_files(manager, original, hdfs_path, step) if original is not None else None,
    )


__all__ = ["load_contents", "save_contents", "target_of"]
