"""verl platform "cpu": plain torch tensors on the host, gloo collectives.

verl 0.9.1 resolves every device question (device name, backend, RNG, memory calls, Ray
resource) through `verl.plugin.platform.get_platform()`; it registers nvidia, huawei and amd
only. This platform answers them for the host. Ray still schedules verl's workers on "GPU"
resources (`_check_resource_available` counts nothing else), so a CPU run declares that many
fake GPUs to Ray (`+ray_kwargs.ray_init.num_gpus=N`, see overrides/cluster/cpu.yaml).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import psutil
import torch
from verl.plugin.platform.platform_base import PlatformBase

NAME = "cpu"


def _host_memory() -> tuple[int, int]:
    vm = psutil.virtual_memory()
    return vm.available, vm.total


def _device_module() -> types.ModuleType:
    """`torch.cpu` plus the torch.cuda-style calls verl makes on `get_torch_device()` (as no-ops
    or host equivalents), so that code written for accelerators runs unchanged."""
    mod = types.ModuleType("slimckpt_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))

    def _zero(*_a: Any, **_k: Any) -> int:
        return 0

    def _none(*_a: Any, **_k: Any) -> None:
        return None

    mod.is_available = lambda: True
    mod.device_count = lambda: 1
    mod.current_device = lambda: NAME
    mod.set_device = _none
    mod.synchronize = _none
    mod.empty_cache = _none
    mod.ipc_collect = _none
    mod.set_per_process_memory_fraction = _none
    mod.reset_peak_memory_stats = _none
    mod.memory_allocated = _zero
    mod.memory_reserved = _zero
    mod.max_memory_allocated = _zero
    mod.max_memory_reserved = _zero
    mod.mem_get_info = lambda *_a, **_k: _host_memory()
    mod.get_device_name = lambda *_a, **_k: "cpu"
    mod.get_rng_state = lambda *_a, **_k: torch.get_rng_state()
    mod.set_rng_state = lambda state, *_a, **_k: torch.set_rng_state(state)
    mod.manual_seed = lambda seed: torch.manual_seed(seed)
    mod.manual_seed_all = lambda seed: torch.manual_seed(seed)
    return mod


class PlatformCPU(PlatformBase):
    """Registered as "cpu" by the "cpu.platform.registry" patch; selected with SLIMCKPT_CPU=1."""

    _module: types.ModuleType | None = None

    @property
    def device_name(self) -> str:
        return NAME

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        if PlatformCPU._module is None:
            PlatformCPU._module = _device_module()
        return PlatformCPU._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: only SLIMCKPT_CPU=1 (or VERL_PLATFORM=cpu) selects it.
        return False

    def current_device(self) -> str:  # type: ignore[override]
        # verl passes this to `.to(...)`, `to_empty(device=...)` and `torch.device(...)`.
        return NAME

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
