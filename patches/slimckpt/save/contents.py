"""verl's own save or load run with only some of its contents (its should_save_* / should_load_*
read the manager's lists): the incremental tier writes the shards itself and leaves verl the rest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def load_contents(manager, contents: list[str]) -> Iterator[None]:
    """Run a load with only `contents` (verl's should_load_* read this list)."""
    loaded = manager.checkpoint_load_contents
    manager.checkpoint_load_contents = list(contents)
    try:
        yield
    finally:
        manager.checkpoint_load_contents = loaded


@contextlib.contextmanager
def save_contents(manager, contents: list[str]) -> Iterator[None]:
    """Run verl's save with only `contents` (its should_save_* read this list)."""
    saved = manager.checkpoint_save_contents
    manager.checkpoint_save_contents = list(contents)
    try:
        yield
    finally:
        manager.checkpoint_save_contents = saved


__all__ = ["load_contents", "save_contents"]
