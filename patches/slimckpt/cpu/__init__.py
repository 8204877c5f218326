"""Run verl 0.9.1's own trainer on a machine without an accelerator (SLIMCKPT_CPU=1 only).

Pieces, each in its own module:
  platform.py     verl platform "cpu" (device "cpu", gloo, host RNG/memory calls)
  fixes.py        replacements for the verl attributes that assume an accelerator (listed as
                  feature "cpu" in slimckpt.verl_patches)
  sample_keys.py  carries each trajectory's (step, sample index, rollout n) to the rollout server
  sampling.py     seeded KV-cached sampling; hf_server.py / rollout.py: the `hf` rollout backend

`activate()` registers the platform, the `hf` rollout and the FSDP engines for device "cpu"; it runs
when slimckpt's plugin applies the "cpu" patches, i.e. on `import verl` with SLIMCKPT_CPU=1.
"""

from __future__ import annotations

import os

from ..import_hooks import when_imported
from ..log import get_logger

log = get_logger("slimckpt.cpu")

ENABLE_ENV = "SLIMCKPT_CPU"
FORCE_ENV = "SLIMCKPT_CPU_FORCE"
_activated = False


def check_host() -> None:
    """Refuse to run on CPU where a GPU is visible, unless the user insists (SLIMCKPT_CPU_FORCE=1)."""
    import torch

    if torch.cuda.is_available() and os.environ.get(FORCE_ENV) != "1":
        raise SystemExit(
            f"[slimckpt] {ENABLE_ENV}=1 asks verl to train on the CPU, but this machine has a CUDA GPU: "
            f"unset {ENABLE_ENV} to train on the GPU, or also set {FORCE_ENV}=1 to run on the CPU anyway"
        )


def _register_rollout(_module=None) -> None:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from .rollout import NAME

    def _load():
        from .rollout import HFReplica

        return HFReplica

    RolloutReplicaRegistry.register(NAME, _load)


def _register_rollout_adapter(module) -> None:
    # verl's table of in-worker rollout classes, looked up by (name, mode).
    module._ROLLOUT_REGISTRY[("hf", "async")] = "slimckpt.cpu.rollout.HFServerAdapter"


def _register_engines(module) -> None:
    """verl registers its FSDP engines for devices cuda and npu only; they run on host tensors too."""
    from verl.workers.engine.base import EngineRegistry

    for model_type, backends in EngineRegistry._engines.items():
        for backend in ("fsdp", "fsdp2"):
            table = backends.get(backend)
            if table is not None and "cuda" in table and "cpu" not in table:
                table["cpu"] = table["cuda"]


def activate() -> None:
    """Idempotent: guard, then register the CPU platform, the hf rollout and the engines."""
    global _activated
    if _activated:
        return
    check_host()
    from verl.plugin.platform import PlatformRegistry

    from .platform import NAME, PlatformCPU

    PlatformRegistry.register(platform=NAME)(PlatformCPU)
    when_imported("verl.workers.rollout.replica", _register_rollout)
    when_imported("verl.workers.rollout.base", _register_rollout_adapter)
    when_imported("verl.workers.engine.fsdp.transformer_impl", _register_engines)
    _activated = True
    log.info("CPU mode: verl platform 'cpu' (gloo), rollout 'hf', FSDP engines on device cpu")
