"""The one start-up line an incremental save on FSDP1 gets: what each save will cost the accelerator.

The incremental tier writes a reshardable state dict (keyed by parameter name). FSDP2 gives it views
of the live shards. FSDP1 (verl's strategy=fsdp) cannot: its SHARDED_STATE_DICT unshards each flat
parameter and cuts and clones every original parameter's rows out of it, and its sharded optimizer
state dict all-gathers each unit's flat AdamW state and clones the rows likewise; the clones of the
whole rank (fp32 model + both moments, 12 bytes per parameter / world size) stay alive until DCP has
written them. verl's own FSDP1 save avoids the device copy only by moving every clone to the host
(offload_to_cpu), i.e. the same bytes in host memory. So the line says how many GiB, and that
strategy=fsdp2 has none; the first save logs the exact figure (state_dicts.note_fsdp1_copy).

Printed in verl's driver (adopt_startup's validate_config hook), once, before Ray starts.
"""

from __future__ import annotations

# lazy imports: torch and transformers load only to count a model's parameters, once per run
import contextlib
import warnings
from typing import Any

from omegaconf import OmegaConf

from ..log import get_logger

log = get_logger("slimckpt.resume")

FP32_MODEL_AND_ADAM = 12  # bytes per parameter: fp32 weights, exp_avg, exp_avg_sq
ROLES = (("actor", "actor_rollout_ref.actor", "actor_rollout_ref.model"), ("critic", "critic", "critic.model"))


def _select(config: Any, key: str, default: Any = None) -> Any:
    return OmegaConf.select(config, key, default=default, throw_on_missing=False)


def parameter_count(model_path: str, trust_remote_code: bool = False) -> int | None:
    """Parameters of the model at `model_path` (a meta model from its config: no weights); None
    when its config cannot be read here."""
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
        return sum(p.numel() for p in model.parameters())
    return None


def fsdp1_roles(config: Any, use_critic: bool) -> list[tuple[str, str]]:
    """(role, model key) of each role that saves incrementally on FSDP1."""
    out = []
    for role, key, model_key in ROLES[: 2 if use_critic else 1]:
        checkpoint = _select(config, f"{key}.checkpoint")
        incremental = bool(_select(checkpoint, "incremental_save", False)) if checkpoint is not None else False
        if incremental and str(_select(config, f"{key}.strategy", "fsdp")) == "fsdp":
            out.append((role, model_key))
    return out


def fsdp1_cost_line(config: Any, use_critic: bool, count=parameter_count) -> str:
    """The line, or "" when no role saves incrementally on FSDP1."""
    roles = fsdp1_roles(config, use_critic)
    if not roles:
        return ""
    world = int(_select(config, "trainer.nnodes", 1) or 1) * int(_select(config, "trainer.n_gpus_per_node", 1) or 1)
    model_key = roles[0][1]
    params = count(
        str(_select(config, f"{model_key}.path")), bool(_select(config, f"{model_key}.trust_remote_code", False))
    )
    size = (
        (
            f"{FP32_MODEL_AND_ADAM * params / world / 2**30:.2f} GiB per GPU at {params / 1e9:.1f}B parameters over "
            f"{world} GPUs"
        )
        if params
        else f"{FP32_MODEL_AND_ADAM} bytes x parameters / {world} GPUs"
    )
    names = " and ".join(r for r, _ in roles)
    return (
        f"slimckpt: FSDP1 (strategy=fsdp) with incremental_save: every {names} save makes its reshardable "
        f"state dict as a copy of the rank's model and optimizer shards on the accelerator, {size}, "
        f"alive while it is written; strategy=fsdp2 (actor_rollout_ref.actor.strategy=fsdp2 "
        f"critic.strategy=fsdp2) saves from views, without a copy"
    )


def say_fsdp1_cost(config: Any, use_critic: bool) -> None:
    try:
        line = fsdp1_cost_line(config, use_critic)
    except Exception as exc:  # noqa: BLE001 - a line of information must not stop a run
        line = f"slimckpt: could not size the FSDP1 save's device copy ({exc})"
    if line:
        log.warning("%s", line)
