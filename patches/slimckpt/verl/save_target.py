"""verl's FSDPCheckpointManager as the engine's SaveTarget: the one place a save or load reads the manager.

Built at each save and load (cheap: references, no copies). Its `state` is the manager's TargetState
(manager_state), kept on the manager for the run; its `saved_paths` is verl's own
`previous_saved_paths` list, which retention updates in place; `side_files` runs verl's own save for
what the engine does not write itself (huggingface/ configs and tokenizer, fsdp_config.json, LoRA
meta, an hf_model gather), with verl's contents narrowed to those; on a URL (`s3://`) verl writes them
into a local scratch dir and they are put on the storage from there.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from verl.utils.fsdp_utils import fsdp_version

from slimckpt.save.target import SaveTarget
from slimckpt.storage import for_path, is_url
from slimckpt.verl.manager_state import config_of, state_of


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


def _put_tree(local: str, url: str) -> list[str]:
    """Every file under the local dir `local` put at the same relative path under `url`, whole."""
    store = for_path(url)
    put = []
    for top, _dirs, files in os.walk(local):
        for name in sorted(files):
            path = os.path.join(top, name)
            rel = os.path.relpath(path, local).replace(os.sep, "/")
            with open(path, "rb") as f:
                store.put_atomic(f"{url.rstrip('/')}/{rel}", f.read())
            put.append(rel)
    return put


def _side_files_through_scratch(manager: Any, original: Callable, url: str, hdfs_path: str | None, step: int) -> None:
    """verl's save writes its side files with open() and save_pretrained into a local dir: on a URL
    they are written into a local scratch dir per rank, and put at `url` by the rank that wrote them
    (rank 0: config, tokenizer, fsdp_config.json; small). verl's save then registers the scratch dir
    as a saved step: the list of saved steps is put back, the step is registered at its commit."""
    saved = list(manager.previous_saved_paths)
    with tempfile.TemporaryDirectory(prefix="slimckpt-side-files-") as scratch:
        try:
            original(manager, scratch, hdfs_path, step, None)
        finally:
            manager.previous_saved_paths[:] = saved
        _put_tree(scratch, url)


def _verl_side_files(manager: Any, original: Callable, hdfs_path: str | None, step: int) -> Callable:
    def side_files(local_path: str, contents: list[str]) -> None:
        # verl's own save for huggingface/, fsdp_config.json, LoRA meta and hf_model; it retains nothing
        with save_contents(manager, contents):
            if is_url(local_path):
                _side_files_through_scratch(manager, original, local_path, hdfs_path, step)
            else:
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
