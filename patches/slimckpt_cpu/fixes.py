"""Replacements for the verl 0.9.1 attributes that assume an accelerator (feature "cpu").

Each `*_patch(original)` builds the replacement for one entry in slimckpt.verl.patch_list; every one
of them is applied only with SLIMCKPT_CPU=1.
"""

# lazy imports: each patch imports verl's and torch's pieces when it is built (applied while `import verl` runs)
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from slimckpt_cpu import check_host

GLOO = "gloo"


def detect_platform_patch(original: Callable[[], str]) -> Callable[[], str]:
    """verl picks its platform by probing nvidia-smi and friends; SLIMCKPT_CPU=1 means "cpu".

    Building the replacement is also where CPU mode refuses a machine with a GPU, because this
    patch is applied at `import verl`, before anything asks verl for its platform."""
    from slimckpt_cpu.platform import NAME

    check_host()

    @functools.wraps(original)
    def _detect_platform_name() -> str:
        return NAME

    return _detect_platform_name


def _plain_gloo(backend: str | None) -> str | None:
    # verl builds "cpu:gloo,<device>:<backend>", i.e. "cpu:gloo,cpu:gloo" here, which torch rejects
    # (one backend per device type).
    if backend is None or set(part.split(":")[-1] for part in backend.split(",")) == {GLOO}:
        return GLOO
    return backend


def process_group_ray_patch(original: Callable) -> Callable:
    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=_plain_gloo(backend))

    return initialize_global_process_group_ray


def process_group_torchrun_patch(original: Callable) -> Callable:
    """verl's torchrun entry points (SFT trainer) build the same double backend string."""

    @functools.wraps(original)
    def initialize_global_process_group(timeout_second=36000):
        import torch.distributed as dist

        dist.init_process_group(
            backend=GLOO,
            timeout=timedelta(seconds=timeout_second),
            init_method=os.environ.get("DIST_INIT_METHOD", None),
        )
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    return initialize_global_process_group


def valuehead_patch(original: Callable) -> Callable:
    """verl's critic loader hard-codes attn_implementation="flash_attention_2" (a CUDA kernel)."""

    @functools.wraps(original)
    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        attn = getattr(model_config, "_attn_implementation", None)
        if attn in (None, "flash_attention_2", "flash_attention_3"):
            attn = "sdpa"
        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path,
            dtype=torch_dtype,
            config=model_config,
            attn_implementation=attn,
            trust_remote_code=trust_remote_code,
        )

    return load_valuehead_model


def offload_policy_patch(original: Any) -> Callable:
    """The reference model gets FSDP2 CPUOffloadPolicy(pin_memory=True); pinning needs an
    accelerator. On the host the parameters are already in host memory: keep the policy, unpinned."""

    @functools.wraps(original, updated=())
    def cpu_offload_policy(pin_memory: bool = True):
        return original(pin_memory=False)

    return cpu_offload_policy
