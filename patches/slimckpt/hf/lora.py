"""LoRA checkpoints (a peft-wrapped actor) in the streaming merge.

verl 0.9.1's merger (`BaseModelMerger.save_lora_adapter`) takes every checkpoint key holding
"lora_" out of the state dict, writes them (".default.weight" -> ".weight") to
`lora_adapter/adapter_model.safetensors` with an `adapter_config.json` (peft's LoraConfig: rank and
alpha from `lora_train_meta.json`, which verl's checkpoint manager writes beside the rank files;
else the rank inferred from the last adapter tensor's shape and alpha 0; target modules the module
names the adapter tensors sit on), and saves the rest as the base model, its names undone
(`base_model.model.` dropped, `.base_layer.weight|bias` -> `.weight|bias`). `plan_lora` plans the
same output: the base model through `HfSide.output_sources` like any checkpoint, and the adapter
as one more planned file, both streamed by the same writers within the same memory bound.

With `merge_lora` (`slimckpt merge --merge_lora`; verl's merger has no such option) each
targeted weight is written as peft's `merge_and_unload()` makes it: W + (B @ A) * lora_alpha / r,
from W, A and B in the output dtype as `PeftModel.from_pretrained` loads them (bf16/fp16: the sum
in fp32, rounded once; `share_writer.lora_merged`), a chunk of W's rows at a time (`layout.LoraDelta`, `share_writer`); there is
no `lora_adapter/` then. Adapters peft's plain Linear merge does not describe (DoRA's magnitude,
embedding adapters, lora_bias, another adapter name, use_rslora in lora_train_meta.json) are refused
in one line, as is an unknown alpha (merging would add nothing).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import slimckpt.layout.safetensors_layout as layout
from slimckpt.engine.checkpoint_dir import CheckpointError
from slimckpt.hf.naming import ConfigMismatch
from slimckpt.hf.plan import EMPTY, ExportPlan, MergeError, plan_takes
from slimckpt.layout.names import (
    DTYPE_CHOICES,
    LORA_ADAPTER_CONFIG,
    LORA_ADAPTER_DIR,
    LORA_ADAPTER_WEIGHTS_PATTERN,
    LORA_TRAIN_META,
    is_lora_key,
)
from slimckpt.log import get_logger

# lazy imports: peft loads only when an adapter_config.json is written

log = get_logger("slimckpt.merge")

ADAPTER_DIR, ADAPTER_CONFIG, ADAPTER_WEIGHTS_PATTERN = (
    LORA_ADAPTER_DIR,
    LORA_ADAPTER_CONFIG,
    LORA_ADAPTER_WEIGHTS_PATTERN,
)
META_NAME = LORA_TRAIN_META
A_SUFFIX, B_SUFFIX, BASE_SUFFIX = ".lora_A.default.weight", ".lora_B.default.weight", ".base_layer.weight"
ONE_FILE = 1 << 62  # the adapter is one file, as safetensors' save_file writes it


def base_output_name(name: str) -> str:
    """A base-model key as verl's merger renames it."""
    return (
        name.replace("base_model.model.", "")
        .replace(".base_layer.weight", ".weight")
        .replace(".base_layer.bias", ".bias")
    )


def adapter_output_name(name: str) -> str:
    """An adapter key as verl's merger writes it into adapter_model.safetensors."""
    return name.replace(".default.weight", ".weight")


@dataclass
class LoraSettings:
    r: int
    lora_alpha: int
    task_type: str | None
    target_modules: list[str]
    meta: dict | None  # lora_train_meta.json as read (verl's fields), None when absent or unreadable
    raw_meta: dict  # the file's whole content ({} when absent): use_rslora/use_dora are looked for here


def read_train_meta(local_dir: str) -> tuple[dict | None, dict]:
    """lora_train_meta.json as verl's `_load_lora_train_meta` reads it (r and lora_alpha as ints,
    task_type a string; an unreadable file or field is a warning and left out), and the raw content."""
    path = os.path.join(local_dir, META_NAME)
    if not os.path.exists(path):
        return None, {}
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except Exception as exc:  # noqa: BLE001 - verl warns and goes on without it
        log.warning("Failed to read LoRA metadata from %s: %s", path, exc)
        return None, {}
    raw = raw if isinstance(raw, dict) else {}
    result: dict = {}
    for key in ("r", "lora_alpha"):
        if key in raw:
            try:
                result[key] = int(raw[key])
            except (TypeError, ValueError):
                log.warning("Invalid %s in %s: %s", "LoRA rank" if key == "r" else key, path, raw[key])
    task_type = raw.get("task_type")
    if isinstance(task_type, str):
        result["task_type"] = task_type
    elif task_type is not None:
        log.warning("Invalid task_type in %s: %s", path, task_type)
    return (result or None), raw


def settings(
    local_dir: str, lora_names: list[str], shapes: dict[str, tuple[int, ...]], meta: dict | None = None
) -> LoraSettings:
    """Rank, alpha, task type and target modules as verl's merger settles them, with its warnings
    (one line when lora_train_meta.json is missing or gives no alpha). `meta`, when given, stands for
    that file's content (an in-training export: what verl's manager writes into it)."""
    targets: set[str] = set()
    for name in lora_names:  # in state-dict order, into a set, as verl does (the set's order is its output's)
        targets.add(adapter_output_name(name).split(".")[-3])
    last = lora_names[-1]
    shape = tuple(shapes[last])
    if len(shape) < 2:
        raise MergeError(
            f"LoRA tensor {last!r} has shape {list(shape)}: verl's merger infers the rank from the "
            f"last adapter tensor's 2 dims and fails on it"
        )
    inferred = min(shape[0], shape[1])
    meta, raw = read_train_meta(local_dir) if meta is None else (meta, dict(meta))
    r, alpha, task_type = inferred, 0, None
    if meta is not None:
        meta_r = meta.get("r")
        if meta_r is not None and meta_r > 0:
            if meta_r != inferred:
                log.warning(
                    "LoRA rank mismatch between metadata (%d) and adapter weights (%d); using metadata rank.",
                    meta_r,
                    inferred,
                )
            r = meta_r
        if meta.get("lora_alpha") is not None:
            alpha = meta["lora_alpha"]
        task_type = meta.get("task_type") or None
    if alpha == 0:
        where = os.path.join(local_dir, META_NAME)
        why = "no " + META_NAME if meta is None else f"{META_NAME} gives no lora_alpha"
        rank_from = "from " + META_NAME if (meta or {}).get("r") else f"inferred from {last!r} {list(shape)}"
        log.warning(
            "LoRA: %s in %s: rank %d %s and lora_alpha 0, as verl's merger infers them (peft then scales "
            'the adapter by 0); write {"r": R, "lora_alpha": A} to %s to set them',
            why,
            local_dir,
            r,
            rank_from,
            where,
        )
    return LoraSettings(r, alpha, task_type, list(targets), meta, raw)


def adapter_config_text(s: LoraSettings) -> str:
    """adapter_config.json as verl's merger writes it: peft's LoraConfig(r, lora_alpha,
    target_modules[, task_type]).to_dict(), enums as their values, indent 4."""
    import peft

    peft_dict: dict = {"r": s.r, "lora_alpha": s.lora_alpha, "target_modules": list(s.target_modules)}
    if s.task_type is not None:
        peft_dict["task_type"] = s.task_type
    config = peft.LoraConfig(**peft_dict).to_dict()
    for key in ("task_type", "peft_type"):
        config[key] = config[key].value if hasattr(config[key], "value") else (config[key] or None)
    config["target_modules"] = list(config["target_modules"])
    return json.dumps(config, ensure_ascii=False, indent=4)


def write_adapter_config(root: str, text: str) -> None:
    os.makedirs(os.path.join(root, ADAPTER_DIR), exist_ok=True)
    with open(os.path.join(root, ADAPTER_DIR, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        f.write(text)


def plan_lora(
    ckpt, hf, dtype: str, max_shard_size, merge_lora: bool, hint: str = "--merge_lora", adapter_only: bool = False
) -> ExportPlan:
    """The plan of a LoRA checkpoint's output (see the module doc); MergeError in one line for what
    is refused. `adapter_only`: a LoRA-only checkpoint (verl's save_lora_only) gets lora_adapter/
    alone instead of a refusal (the in-training export)."""
    names = list(ckpt.tensors)
    shapes = {n: tuple(t.shape) for n, t in ckpt.tensors.items()}
    lora_names = [n for n in names if is_lora_key(n)]
    renamed: dict[str, str] = {}
    for n in names:
        if is_lora_key(n):
            continue
        new = base_output_name(n)
        if new in renamed:
            raise MergeError(
                f"{ckpt.tensors[n].file_of(0)}: {n!r} and {renamed[new]!r} both become {new!r} once "
                f"peft's names are undone"
            )
        renamed[new] = n
    if not renamed and (merge_lora or not adapter_only):
        why = (
            f"; set {hint.split('=')[0]}=false to export lora_adapter/ alone"
            if merge_lora and adapter_only
            else "; merge a checkpoint saved with the whole model"
        )
        raise MergeError(
            f"{ckpt.local_dir} holds LoRA weights only (verl's save_lora_only): there is no base "
            f"model to write{' the adapter into' if merge_lora else ''}{why}"
        )
    try:
        takes = hf.output_sources(list(renamed), {new: shapes[old] for new, old in renamed.items()}) if renamed else {}
    except ConfigMismatch as exc:
        raise CheckpointError(f"{ckpt.tensors[renamed[exc.name]].file_of(0)}: {exc}") from None
    takes = {out: layout.Take(renamed[t.source], t.shape, t.span) for out, t in takes.items()}
    s = settings(ckpt.local_dir, lora_names, shapes)
    total_parameters = hf.total_parameters()
    if merge_lora:
        takes = merged_takes(ckpt.local_dir, takes, lora_names, shapes, s, hint)
        log.info(
            "LoRA: merging the adapter into the base weights (W + B @ A x %s / %d) for %d modules; no %s/",
            s.lora_alpha,
            s.r,
            sum(t.delta is not None for t in takes.values()),
            ADAPTER_DIR,
        )
        return plan_takes(ckpt, takes, dtype, max_shard_size, total_parameters)
    model = (
        plan_takes(ckpt, takes, dtype, max_shard_size, total_parameters)
        if takes
        else ExportPlan(EMPTY, {}, total_parameters, world_size=ckpt.world_size, fsdp_version=ckpt.fsdp_version)
    )
    adapter_takes = {adapter_output_name(n): layout.Take(n, shapes[n]) for n in lora_names}
    if len(adapter_takes) != len(lora_names):
        raise MergeError(f"two LoRA tensors of {ckpt.local_dir} have one name once '.default' is dropped")
    st_dtype = DTYPE_CHOICES[dtype]
    clash = sorted(set(adapter_takes) & set(model.plan.placements))
    if clash:
        raise MergeError(f"LoRA tensor {clash[0]!r} has a base model tensor's name")
    both = with_adapter_files(model.plan, [layout.TensorSpec(n, st_dtype, t.shape) for n, t in adapter_takes.items()])
    log.info(
        "LoRA: base model with peft's names undone, and %s/ (%d adapter tensors, r=%d, lora_alpha=%s, "
        "target modules %s), as verl's merger writes them",
        ADAPTER_DIR,
        len(adapter_takes),
        s.r,
        s.lora_alpha,
        sorted(s.target_modules),
    )
    return ExportPlan(
        both,
        {**model.takes, **adapter_takes},
        total_parameters,
        index_plan=model.plan,
        adapter_config=adapter_config_text(s),
        world_size=model.world_size,
        fsdp_version=model.fsdp_version,
        source_format=getattr(ckpt, "source_format", "verl_fsdp"),
    )


def with_adapter_files(model: layout.Plan, specs: list[layout.TensorSpec]) -> layout.Plan:
    """`model`'s files plus lora_adapter/adapter_model.safetensors holding `specs` (one file, as
    safetensors' save_file writes it)."""
    adapter = layout.plan_files(specs, ONE_FILE, metadata=None, pattern=ADAPTER_WEIGHTS_PATTERN)
    return layout.Plan(
        files=model.files + adapter.files,
        total_size=model.total_size + adapter.total_size,
        placements={**model.placements, **adapter.placements},
    )


def merged_takes(
    local_dir: str, takes: dict[str, layout.Take], lora_names: list[str], shapes: dict, s: LoraSettings, hint: str
) -> dict[str, layout.Take]:
    """`takes` with each adapted weight's take carrying its LoRA delta (the offline merge's and the
    incremental tier's export's one rule of what is merged and what is refused)."""
    for key in ("use_rslora", "use_dora"):
        if s.raw_meta.get(key):
            raise MergeError(
                f"{hint}: {os.path.join(local_dir, META_NAME)} sets {key}, which this merge does "
                f"not support (verl's adapter_config.json does not record it either); merge without "
                f"{hint} and use peft's merge_and_unload()"
            )
    if not s.lora_alpha:
        raise MergeError(
            f"{hint}: lora_alpha is unknown ({META_NAME} is missing or gives none), so the merge "
            f'would add 0 x B @ A; write {{"r": {s.r}, "lora_alpha": A}} to '
            f"{os.path.join(local_dir, META_NAME)} (verl writes it with every LoRA checkpoint)"
        )
    scaling = s.lora_alpha / s.r  # peft's LoraLayer.update_layer (use_rslora False)
    by_source = {t.source: out for out, t in takes.items() if t.whole}
    pairs = 0
    for name in lora_names:
        if name.endswith(B_SUFFIX):
            if name[: -len(B_SUFFIX)] + A_SUFFIX not in shapes:
                raise MergeError(f"{hint}: {name!r} has no A weight in the checkpoint; merge without {hint}")
            continue
        if not name.endswith(A_SUFFIX):
            raise MergeError(
                f"{hint}: {name!r} is not the A or B weight of a peft LoRA Linear named 'default' "
                f"(an embedding adapter, DoRA's magnitude, lora_bias or another adapter): not "
                f"supported; merge without {hint}"
            )
        prefix = name[: -len(A_SUFFIX)]
        b, w = prefix + B_SUFFIX, prefix + BASE_SUFFIX
        if w not in shapes and any(k.startswith(prefix + ".base_layer.") for k in shapes):
            # peft's target_parameters (a ParamWrapper: what all-linear adapts on fused MoE experts)
            raise MergeError(
                f"{hint}: {name!r} adapts a module's parameters (peft's target_parameters, e.g. fused "
                f"MoE experts), not a Linear's weight: not supported; merge without {hint}"
            )
        if b not in shapes or w not in shapes:
            raise MergeError(
                f"{hint}: {name!r} has no {'B weight' if b not in shapes else 'base weight'} "
                f"({b if b not in shapes else w!r}) in the checkpoint; merge without {hint}"
            )
        a_shape, b_shape, w_shape = shapes[name], shapes[b], shapes[w]
        if len(w_shape) != 2 or a_shape != (s.r, w_shape[1]) or b_shape != (w_shape[0], s.r):
            raise MergeError(
                f"{hint}: {w!r} {list(w_shape)} with A {list(a_shape)} and B {list(b_shape)} is not "
                f"W [out, in] + B [out, {s.r}] @ A [{s.r}, in] (r={s.r}); merge without {hint}"
            )
        out = by_source.get(w)
        if out is None:
            raise MergeError(
                f"{hint}: the adapted weight {w!r} is not written whole to the output (split or "
                f"dropped on save): not supported; merge without {hint}"
            )
        takes[out] = layout.Take(w, takes[out].shape, None, layout.LoraDelta(name, b, scaling))
        pairs += 1
    if not pairs:
        raise MergeError(f"{hint}: the checkpoint's LoRA tensors hold no A/B pair to merge; merge without {hint}")
    return takes
