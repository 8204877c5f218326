"""The start-up check of an incremental save on FSDP1: what each save costs the GPU, and a stop
where it does not fit.

The incremental tier writes a reshardable state dict (keyed by parameter name). FSDP2 gives it views
of the live shards. FSDP1 (verl's strategy=fsdp) cannot: its SHARDED_STATE_DICT unshards each flat
parameter and cuts and clones every original parameter's rows out of it, and its sharded optimizer
state dict cuts AdamW's rows out of each unit's flat state likewise; the clones of the whole rank
(fp32 model + both moments, 12 bytes per parameter / world size) stay alive until DCP has written
them. verl's own FSDP1 save avoids the device copy only by moving every clone to the host
(offload_to_cpu), i.e. the same bytes in host memory.

So, in verl's driver before Ray starts (adopt_startup's validate_config hook) and in `slimckpt
dryrun --plan`: one line sizes the copy, and the GPU's peak at a save (slimckpt.save.device_budget:
training's state on the GPU + the copy + the gathered unit + a reserve) is compared with the GPU's
memory: SLIMCKPT_GPU_MEMORY_GB, else the free memory of the driver's GPU. A run it does not fit
stops there in one line naming strategy=fsdp2 and `checkpoint.allow_fsdp1_device_copy=true`, which
starts it anyway; where no GPU memory is known the line says how to have it checked. The first save
logs the exact figure (state_dicts.note_fsdp1_copy).
"""

from __future__ import annotations

# lazy imports: transformers loads only to count a model's parameters, once per run (torch is verl's)
import contextlib
import json
import warnings
from typing import Any

import torch
from omegaconf import OmegaConf

from slimckpt.env_vars import integer
from slimckpt.log import get_logger
from slimckpt.save.device_budget import RoleOnGpu, gib, gpu_peak

log = get_logger("slimckpt.resume")

FP32_MODEL_AND_ADAM = 12  # bytes per parameter: fp32 weights, exp_avg, exp_avg_sq
ROLES = (("actor", "actor_rollout_ref.actor", "actor_rollout_ref.model"), ("critic", "critic", "critic.model"))


def _select(config: Any, key: str, default: Any = None) -> Any:
    return OmegaConf.select(config, key, default=default, throw_on_missing=False)


def parameter_count(model_path: str, trust_remote_code: bool = False) -> int | None:
    """Parameters of the model at `model_path` (a meta model from its config: no weights); None
    when its config cannot be read here."""
    found = model_shape(model_path, trust_remote_code)
    return found[0] if found else None


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
    world = _world(config)
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


def _world(config: Any) -> int:
    return int(_select(config, "trainer.nnodes", 1) or 1) * int(_select(config, "trainer.n_gpus_per_node", 1) or 1)


def model_shape(model_path: str, trust_remote_code: bool = False) -> tuple[int, int] | None:
    """(parameters, parameters of the largest FSDP unit: a block verl wraps, its _no_split_modules) of
    the model at `model_path` (a dir, or a config.json), from a meta model; None when unreadable."""
    with contextlib.suppress(Exception), warnings.catch_warnings():
        warnings.simplefilter("ignore")

        from transformers import AutoConfig, AutoModelForCausalLM

        if model_path.endswith(".json"):
            with open(model_path) as f:
                raw = json.load(f)
            cfg = AutoConfig.for_model(raw.pop("model_type"), **raw)
        else:
            cfg = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
        wrapped = set(getattr(model, "_no_split_modules", None) or [])
        units = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in wrapped]
        return sum(p.numel() for p in model.parameters()), max(units, default=0)
    return None


def gpu_memory_bytes() -> tuple[int | None, str]:
    """(bytes of one training GPU, where that figure comes from), or (None, why there is none)."""
    gib = integer("SLIMCKPT_GPU_MEMORY_GB")
    if gib > 0:
        return gib * 2**30, f"SLIMCKPT_GPU_MEMORY_GB={gib}"
    with contextlib.suppress(Exception):
        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            return int(free), "free on this node's GPU at start-up"
    return None, "no GPU visible to the driver"


def _role_on_gpu(config: Any, role: str, key: str, elements: int, unit: int, copies: bool) -> RoleOnGpu:
    fsdp = f"{key}.fsdp_config" if role == "actor" else "critic.fsdp"
    return RoleOnGpu(
        role,
        elements,
        param_offload=bool(_select(config, f"{fsdp}.param_offload", False)),
        optimizer_offload=bool(_select(config, f"{fsdp}.optimizer_offload", False)),
        copies_on_save=copies,
        unit_elements=unit,
    )


def _allowed(config: Any, key: str) -> bool:
    return bool(_select(config, f"{key}.checkpoint.allow_fsdp1_device_copy", False))


def fsdp1_check(
    config: Any,
    use_critic: bool,
    use_ref: bool = False,
    gpu: tuple[int | None, str] | None = None,
    shape=None,
    model_json: str | None = None,
) -> tuple[str, bool]:
    """(the line, whether the run must stop) for the FSDP1 incremental saves of `config`; ("", False)
    when there are none. `model_json` stands in for the model's own dir (a dry run's shipped config)."""
    copying = fsdp1_roles(config, use_critic)
    if not copying:
        return "", False
    world = _world(config)
    model_key = "actor_rollout_ref.model"
    found = (shape or model_shape)(
        model_json or str(_select(config, f"{model_key}.path")), bool(_select(config, f"{model_key}.trust_remote_code"))
    )
    cost = fsdp1_cost_line(config, use_critic, count=lambda *_: found[0] if found else None)
    if found is None:
        return cost + "; the model's config is not readable here, so its GPU peak is not checked", False
    params, unit = found
    names = {r for r, _ in copying}
    roles = [_role_on_gpu(config, "actor", "actor_rollout_ref.actor", params // world, unit, "actor" in names)]
    if use_critic:
        roles.append(_role_on_gpu(config, "critic", "critic", params // world, unit, "critic" in names))
    ref_offload = bool(_select(config, "actor_rollout_ref.ref.fsdp_config.param_offload", False))
    gpu_bytes, source = gpu if gpu is not None else gpu_memory_bytes()
    if gpu_bytes is None:
        return cost + f"; {source}: set SLIMCKPT_GPU_MEMORY_GB=<GiB per GPU> to have its GPU peak checked", False
    peak = gpu_peak(roles, gpu_bytes, params // world if use_ref else 0, ref_offload)
    held = ", ".join(f"{name} {gib(n)}" for name, n in peak.parts.items() if n) or "nothing"
    arithmetic = (
        f"at the {peak.saving}'s save a GPU holds {gib(peak.need)} (training's state: {held}; the save's copy and "
        f"gathered unit {gib(peak.save)}; reserve {gib(peak.reserve)}) of {gib(gpu_bytes)} ({source})"
    )
    where = (
        f"; the {peak.host_copy_role}'s AdamW rows are copied in host memory instead "
        f"({gib(peak.host_copy)} per rank: its optimizer_offload)"
    )
    where = where if peak.host_copy else ""
    role_keys = {"actor": "actor_rollout_ref.actor", "critic": "critic"}
    if peak.fits or all(_allowed(config, role_keys[r]) for r in names):
        verdict = "fits" if peak.fits else "does NOT fit, started anyway (allow_fsdp1_device_copy=true)"
        return (
            f"{cost}; {arithmetic}: {verdict}, {gib(abs(peak.spare))} {'to spare' if peak.fits else 'over'}{where}",
            False,
        )
    overrides = " ".join(f"{role_keys[r]}.checkpoint.allow_fsdp1_device_copy=true" for r in sorted(names))
    return (
        f"slimckpt: an incremental save on FSDP1 does not fit the GPU: {arithmetic}; use "
        f"actor_rollout_ref.actor.strategy=fsdp2 critic.strategy=fsdp2 (no copy), or start anyway with {overrides}"
    ), True


def say_fsdp1_cost(config: Any, use_critic: bool, use_ref: bool = False) -> None:
    """Log the line; stop the run (SystemExit, before Ray starts) where the save does not fit."""
    try:
        line, stop = fsdp1_check(config, use_critic, use_ref)
    except Exception as exc:  # noqa: BLE001 - a line of information must not stop a run
        line, stop = f"slimckpt: could not size the FSDP1 save's device copy ({exc})", False
    if stop:
        raise SystemExit(line)
    if line:
        log.warning("%s", line)
