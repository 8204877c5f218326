"""The model a plan is made for, read from its config alone: a meta-device model (shapes, no
weights) built by slimckpt.hf.naming as the merge builds it, its parameters as FSDP shards them,
the names the export drops (tied) or splits (fused MoE experts) and the Hugging Face export's file
layout (planned by slimckpt.layout.safetensors_layout, as the merger writes it).

A LoRA actor is wrapped as verl wraps it, by peft on the meta model: the base model is frozen (in
the model shards, no AdamW state), the adapter trained in fp32; the HF export is the base model plus
lora_adapter/ (as verl's merger writes it). A vision-language config (Qwen2.5-VL) is planned with
its vision tower, and its export laid out as save_pretrained writes it.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import slimckpt.layout.safetensors_layout as layout
from slimckpt.hf.naming import HfSide, default_max_shard_size
from slimckpt.layout.names import DTYPE_CHOICES as DTYPE_NAMES
from slimckpt.log import quieted
from slimckpt.plan.cost import ParamSpec

# lazy imports: torch, numpy and peft load only when a model is measured (`slimckpt --help` imports the plan's command)


@dataclass
class ModelFacts:
    params: list[ParamSpec]
    total_parameters: int
    tied: list[str]
    hf_files: list[tuple[str, int]]  # (file name, bytes) of the HF export
    hf_bytes: int
    hf_dtype: str
    max_shard_size: str | int
    # fused tensors transformers splits on save (MoE experts) -> the outputs made of them
    split_on_save: dict[str, int] = field(default_factory=dict)
    # a LoRA actor: rank, alpha, the modules wrapped, the adapter's parameters and its export bytes
    lora: dict[str, Any] | None = None
    # a vision-language model: parameters of its vision tower (all of them are in `params`)
    vision_parameters: int = 0


@dataclass(frozen=True)
class LoraSpec:
    """verl's actor_rollout_ref.model.lora_rank / lora_alpha / target_modules / exclude_modules."""

    rank: int
    alpha: float = 16
    target_modules: str | tuple[str, ...] = "all-linear"
    exclude_modules: tuple[str, ...] = ()
    target_parameters: tuple[str, ...] = ()


def _hf_dir(config_path: str) -> tuple[str, Any]:
    """slimckpt.hf.naming.HfSide reads `<dir>/huggingface/config.json` (a checkpoint's layout); give it
    one that holds just this config."""
    src = os.path.join(config_path, "config.json") if os.path.isdir(config_path) else config_path
    if not os.path.isfile(src):
        raise FileNotFoundError(f"slimckpt plan: {src} does not exist; pass a model's config.json (or its dir)")
    tmp = tempfile.TemporaryDirectory(prefix="slimckpt-plan-")
    os.makedirs(os.path.join(tmp.name, "huggingface"))
    shutil.copy(src, os.path.join(tmp.name, "huggingface", "config.json"))
    return tmp.name, tmp


def model_facts(
    config_path: str,
    export_dtype: str = "bf16",
    max_shard_size: str | int | None = None,
    trust_remote_code: bool = False,
    lora: LoraSpec | None = None,
) -> ModelFacts:
    root, keep = _hf_dir(config_path)
    # verl prints a warning about the missing generation config on stdout; keep stdout for the report
    with keep, contextlib.redirect_stdout(sys.stderr):
        with quieted("slimckpt.merge"):  # its missing-generation-config warning names this temp dir: a plan writes none
            hf = HfSide(root, export_dtype, trust_remote_code)
        model = hf.model
        state = model.state_dict()
        shapes = {n: tuple(t.shape) for n, t in state.items()}
        # output name -> the state dict tensor (or the part of one: an expert of a fused MoE tensor) it is
        takes = hf.output_sources(list(state), shapes)
        # the meta model is built untied; tied targets are what the export drops (verl's
        # drop_tied_target_keys), and they are one tensor with their source in training
        used = {t.source for t in takes.values()}
        tied = [n for n in state if n not in used]
        trainable = {n for n, p in model.named_parameters()}
        params = [ParamSpec(n, shapes[n], n in trainable) for n in state if n not in tied]
        size = max_shard_size if max_shard_size is not None else default_max_shard_size()
        specs = [layout.TensorSpec(new, DTYPE_NAMES[export_dtype], take.shape) for new, take in takes.items()]
        plan = layout.plan_files(specs, size)
        split: dict[str, int] = {}
        for take in takes.values():
            if not take.whole:
                split[take.source] = split.get(take.source, 0) + 1
        files = [(f.name, f.size) for f in plan.files]
        total = hf.total_parameters()  # of the base model: before peft wraps it
        lora_facts = None
        if lora is not None:
            params, files, lora_facts = _with_lora(model, params, files, lora, export_dtype)
        vision = sum(t.numel() for n, t in state.items() if n not in tied and _is_vision(n))
        return ModelFacts(
            params=params,
            total_parameters=total + (lora_facts or {}).get("parameters", 0),
            tied=tied,
            hf_files=files,
            hf_bytes=sum(b for _, b in files),
            hf_dtype=export_dtype,
            max_shard_size=size,
            split_on_save=split,
            lora=lora_facts,
            vision_parameters=vision,
        )


def _is_vision(name: str) -> bool:
    """A vision tower's tensor (Qwen2-VL/2.5-VL `visual.`, LLaVA-style `vision_tower.`, projectors)."""
    parts = name.split(".")
    return any(p in ("visual", "vision_tower", "vision_model", "multi_modal_projector") for p in parts)


def _with_lora(
    model, params: list[ParamSpec], files: list[tuple[str, int]], lora: LoraSpec, export_dtype: str
) -> tuple[list[ParamSpec], list[tuple[str, int]], dict[str, Any]]:
    """A LoRA actor, wrapped as verl wraps it (peft's get_peft_model with verl's LoraConfig keys, on
    the meta model): the base frozen (no AdamW state), the adapter trainable fp32 (on fused MoE
    experts too, where peft puts it); the export adds lora_adapter/ (what verl's merger and
    slimckpt's exports write), its tensors in export_dtype."""
    from peft import LoraConfig, TaskType, get_peft_model

    if lora.rank < 1:
        raise ValueError(f"slimckpt plan: --lora-rank {lora.rank}: give the adapter's rank, 1 or more")
    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules),
        target_parameters=list(lora.target_parameters) or None,
        exclude_modules=list(lora.exclude_modules) or None,
        bias="none",
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = get_peft_model(model, config)
    except ValueError as exc:
        raise ValueError(f"slimckpt plan: LoRA ({_lora_keys(lora)}): {str(exc).strip().splitlines()[0]}") from None
    adapter = [
        ParamSpec(n.removeprefix("base_model.model."), tuple(t.shape))
        for n, t in wrapped.named_parameters()
        if t.requires_grad
    ]
    specs = [
        layout.TensorSpec("base_model.model." + p.name.replace(".default.", "."), DTYPE_NAMES[export_dtype], p.shape)
        for p in adapter
    ]
    adapter_bytes = sum(f.size for f in layout.plan_files(specs, 1 << 62).files)
    modules = {p.name.split(".lora_")[0] for p in adapter}
    facts = {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "modules": len(modules),
        "keys": _lora_keys(lora),
        "parameters": sum(p.rows * (p.row_bytes // p.itemsize) for p in adapter),
        "adapter_bytes": adapter_bytes,
    }
    frozen = [replace(p, trainable=False) for p in params]
    return frozen + adapter, files + [("lora_adapter/adapter_model.safetensors", adapter_bytes)], facts


def _lora_keys(lora: LoraSpec) -> str:
    def show(v) -> str:
        return v if isinstance(v, str) else ",".join(v)

    out = f"target_modules={show(lora.target_modules)}"
    if lora.target_parameters:
        out += f" target_parameters={show(lora.target_parameters)}"
    if lora.exclude_modules:
        out += f" exclude_modules={show(lora.exclude_modules)}"
    return out


def extra_state_bytes() -> int:
    """Pickled size of the RNG states verl saves per rank (lr scheduler state adds ~1 KiB)."""
    import numpy as np
    import torch

    buf = io.BytesIO()
    torch.save(
        {"rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}}, buf
    )
    return buf.tell()
