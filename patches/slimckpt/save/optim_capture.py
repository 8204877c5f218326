"""The optimizer's part of a step, taken and put back without changing the optimizer.

torch's get_optimizer_state_dict and set_optimizer_state_dict first "initialize" an optimizer that
has no state yet (`_init_optim_state`): a zero grad for every parameter and an `optimizer.step()`
at lr 0. For an actor saved before its first update (PPO's `trainer.critic_warmup`), that makes
Adam's step count 1, so its next real update is not verl's, and allocates grads and both moments
at save time. verl's own save takes `optimizer.state_dict()` as it is (an empty `state` then) and
its load puts that back. Here, likewise:

  - a save takes the state as it is: no initialization (with state, torch's would do nothing;
    on a torch slimckpt.internals has not checked `_init_optim_state` on, torch's runs);
  - a load of a step that holds optimizer state keeps torch's initialization: it creates the
    tensors DCP reads into, and the load overwrites all of them;
  - a load of a step without optimizer state reads its param_groups only and leaves the
    optimizer without state, as verl's load of such a step does.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint import state_dict as torch_state_dict
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from slimckpt import internals
from slimckpt.engine.dcp_pickle import CheckedFileSystemReader
from slimckpt.storage import absolute

STATE_PREFIX = "optim.state."  # DCP's flattened keys of the optimizer's per-parameter state


@contextlib.contextmanager
def without_init() -> Iterator[None]:
    """torch's optimizer state-dict calls, minus their initialization of an optimizer without
    state. Where torch has no such step, nothing to undo."""
    original = internals.lookup("torch.distributed.checkpoint.state_dict:_init_optim_state")
    if original is None:
        yield
        return
    torch_state_dict._init_optim_state = lambda optim: None
    try:
        yield
    finally:
        torch_state_dict._init_optim_state = original


def capture(model: Any, optimizer: Any, options: Any) -> dict[str, Any]:
    """The optimizer's sharded state dict as it is now (no state before the first step)."""
    with warnings.catch_warnings(), without_init():
        warnings.simplefilter("ignore")
        return get_optimizer_state_dict(model, optimizer, options=options)


def saved_with_state(dcp_dir: str) -> bool:
    """Whether the step's DCP checkpoint holds per-parameter optimizer state."""
    keys = CheckedFileSystemReader(absolute(dcp_dir)).read_metadata().state_dict_metadata
    return any(k.startswith(STATE_PREFIX) for k in keys)


def load_template(model: Any, optimizer: Any, options: Any, with_state: bool) -> dict[str, Any]:
    """What DCP loads the optimizer's part into: every state tensor when the step has them (torch
    initializes a fresh optimizer for that), else the param_groups alone."""
    if with_state:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return get_optimizer_state_dict(model, optimizer, options=options)
    template = capture(model, optimizer, options)
    template["state"] = {}
    return template


def apply(model: Any, optimizer: Any, loaded: dict[str, Any], options: Any) -> None:
    """Put the loaded optimizer part back; a step without state leaves the optimizer without any."""
    with warnings.catch_warnings(), without_init() if not loaded.get("state") else contextlib.nullcontext():
        warnings.simplefilter("ignore")
        set_optimizer_state_dict(model, optimizer, loaded, options=options)
