"""The entries CPU mode adds to verl's tables, one builder per entry of slimckpt.verl.patch_list
(feature "cpu"): the platform, the `hf` rollout's two halves and the FSDP engines for device cpu.
Each builder receives the table it adds to and returns the value of its entry."""

# lazy imports: each builder imports its class when verl's table asks for it (the classes import verl's workers)
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def platform_class(_platforms: dict) -> type:
    from slimckpt_cpu.platform import PlatformCPU

    return PlatformCPU


def _load_replica() -> type:
    from slimckpt_cpu.rollout import HFReplica

    return HFReplica


def replica_loader(_registry: dict) -> Callable[[], type]:
    """RolloutReplicaRegistry keeps loaders, so the replica's module is imported only when chosen."""
    return _load_replica


def adapter_path(_registry: dict) -> str:
    # verl's table of in-worker rollout classes, looked up by (name, mode), holds import paths
    return "slimckpt_cpu.rollout.HFServerAdapter"


def cuda_engine(devices: dict) -> Any:
    """verl's FSDP engines are registered for devices cuda and npu; the cuda class runs on host tensors."""
    return devices["cuda"]
