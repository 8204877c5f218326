"""What runs before anything changes the shards an async_save=stream write is still reading.

While a stream write is in flight its StreamCapture is active here, and every mutation path
calls `before_mutation` first, which runs the capture's guard (copy what is unread within the
budget, wait for the writer for the rest; slimckpt.save.modes.stream_capture):

- the optimizer step: a step pre-hook on the manager's optimizer (torch's
  Optimizer.register_step_pre_hook), registered at submit; it is inert once the write ends and
  removed on the training thread at the next wait or save (removing it from the writer thread
  could change the hook table while the optimizer iterates it);
- verl's checkpoint load: the load patch (verl.checkpoint_patches.wrap_load_checkpoint) waits for the write;
- verl 0.9.1's FSDP engine (verl.workers.engine.fsdp.transformer_impl, the only FSDP worker code
  that version has): merged_lora_context, which merges LoRA into the base weights in place for
  the weight sync; wrapped through the patch registry (patch_list: checkpoint.stream_guard.*).

verl's parameter and optimizer offload and reload (the same module's offload_fsdp_model_to_cpu,
load_fsdp_model_to_gpu, offload_fsdp_optimizer, load_fsdp_optimizer, called around the update and
the save with param_offload / optimizer_offload) change no tensor in place: each makes new tensors
on the other side and drops the old ones. So they run no guard; the write follows them instead
(StreamCapture.before_move / after_move): after an offload each unread source reads the host copy
verl made and the device tensor is released (no copy of ours, no device memory held past the
offload but a tensor the writer is copying to the host at that moment, until that copy ends);
after a reload an unread source keeps the host tensor verl's reload dropped, a reference until the
writer has read it, and the update's changes to the new device tensor cannot reach it. On CUDA
the offload's copies are non-blocking: the writer waits for an event recorded after them before
it reads one. A source no live tensor views (FSDP1's sharded state dict, new tensors) is not
moved by an offload: it is still copied to the host by the guard there, within the budget.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from slimckpt.save.modes.stream_capture import StreamCapture

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


def model_tensors(model: Any) -> list[tuple[str, Any]]:
    """What a module's move replaces: its parameters and buffers, by name."""
    return [*(("p." + n, t) for n, t in model.named_parameters()), *(("b." + n, t) for n, t in model.named_buffers())]


def optimizer_tensors(optimizer: Any) -> list[tuple[str, Any]]:
    """What verl's optimizer offload and reload replace: the state tensors of each parameter, by
    (group, parameter, key), in the order they walk them."""
    out = []
    for g, group in enumerate(getattr(optimizer, "param_groups", ())):
        for i, param in enumerate(group["params"]):
            for key, value in (optimizer.state.get(param) or {}).items():
                if isinstance(value, torch.Tensor):
                    out.append((f"{g}.{i}.{key}", value))
    return out


def _cuda_device(tensors: list[tuple[str, Any]]):
    """The CUDA device of the first moved tensor on one, else None."""
    if not torch.cuda.is_available():
        return None
    for _, t in tensors:
        local = getattr(t, "_local_tensor", t)
        if local.device.type == "cuda":
            return local.device
    return None


def _following(what: str, offload: bool, tensors_of: Callable[[Any], list[tuple[str, Any]]]):
    """verl's move of a model's or optimizer's tensors (its first argument), followed by every
    active capture (see the module docstring)."""

    def wrap(original):
        @functools.wraps(original)
        def moving(*args, **kwargs):
            with _LOCK:
                active = [c for c in _ACTIVE if not c.closed]
            owner = args[0] if args else kwargs.get("model", kwargs.get("optimizer"))
            if not active or owner is None:
                return original(*args, **kwargs)
            before = tensors_of(owner)
            tokens = [capture.before_move(before, what) for capture in active]
            device = _cuda_device(before)
            try:
                return original(*args, **kwargs)
            finally:
                now = dict(tensors_of(owner))
                ready = None
                if offload and device is not None:  # verl's copies to the host are non-blocking
                    ready = torch.cuda.Event()
                    ready.record(torch.cuda.current_stream(device))
                for capture, token in zip(active, tokens):
                    capture.after_move(token, now, offload, ready)
                if offload:  # what the move does not follow (sources no live tensor views) leaves the device here
                    for capture in active:
                        capture.guard(what, lambda s: s.orphan and s.live.device.type != "cpu")
                    if device is not None:  # what the write released, returned as verl's own offload returns it
                        torch.cuda.empty_cache()

        return moving

    return wrap


wrap_offload_model = _following("parameter offload (offload_fsdp_model_to_cpu)", True, model_tensors)
wrap_load_model = _following("parameter reload (load_fsdp_model_to_gpu)", False, model_tensors)
wrap_offload_optimizer = _following("optimizer offload (offload_fsdp_optimizer)", True, optimizer_tensors)
wrap_load_optimizer = _following("optimizer reload (load_fsdp_optimizer)", False, optimizer_tensors)
wrap_merged_lora = _guarding("the LoRA merge for weight sync (merged_lora_context)")
