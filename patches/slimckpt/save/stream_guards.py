"""What runs before anything changes the shards an async_save=stream write is still reading.

While a stream write is in flight its StreamCapture is active here, and every mutation path
calls `before_mutation` first, which runs the capture's guard (copy what is unread within the
budget, wait for the writer for the rest; slimckpt.save.stream_capture):

- the optimizer step: a step pre-hook on the manager's optimizer (torch's
  Optimizer.register_step_pre_hook), registered at submit; it is inert once the write ends and
  removed on the training thread at the next wait or save (removing it from the writer thread
  could change the hook table while the optimizer iterates it);
- verl's checkpoint load: the load patch (resume_state.wrap_load_checkpoint) waits for the write;
- verl 0.9.1's FSDP engine (verl.workers.engine.fsdp.transformer_impl, the only FSDP worker code
  that version has): parameter and optimizer offload and reload, which move storage, and
  merged_lora_context, which merges LoRA into the base weights in place for the weight sync;
  wrapped through the patch registry (patch_list: checkpoint.stream_guard.*).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from .stream_capture import StreamCapture

_ACTIVE: list[StreamCapture] = []
_LOCK = threading.Lock()


def activate(capture: StreamCapture, optimizer: Any | None) -> Callable[[], None]:
    """Guard `capture` until it closes; returns what removes its optimizer hook (call it on the
    training thread)."""
    with _LOCK:
        _ACTIVE.append(capture)
    handle = None
    if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
        def step_pre_hook(_optimizer, _args, _kwargs) -> None:
            if not capture.closed:
                capture.guard("the optimizer step")

        handle = optimizer.register_step_pre_hook(step_pre_hook)
    return handle.remove if handle is not None else (lambda: None)


def deactivate(capture: StreamCapture) -> None:
    """The write ended: no guard waits for it any more (called on the writer's thread)."""
    capture.close()
    with _LOCK:
        if capture in _ACTIVE:
            _ACTIVE.remove(capture)


def before_mutation(what: str) -> float:
    """Run every active capture's guard; the seconds this blocked."""
    with _LOCK:
        active = list(_ACTIVE)
    return sum(capture.guard(what) for capture in active)


def _guarding(what: str):
    def wrap(original):
        @functools.wraps(original)
        def guarded(*args, **kwargs):
            before_mutation(what)
            return original(*args, **kwargs)

        return guarded

    return wrap


wrap_offload_model = _guarding("parameter offload (offload_fsdp_model_to_cpu)")
wrap_load_model = _guarding("parameter reload (load_fsdp_model_to_gpu)")
wrap_offload_optimizer = _guarding("optimizer offload (offload_fsdp_optimizer)")
wrap_load_optimizer = _guarding("optimizer reload (load_fsdp_optimizer)")
wrap_merged_lora = _guarding("the LoRA merge for weight sync (merged_lora_context)")
