"""Gather-free HF export of the incremental tier: every rank writes its own rows of each
parameter straight into `<step>/<role>/huggingface/*.safetensors` at their planned offsets.

verl's `hf_model` save gathers the whole model into rank 0's host RAM (fp32, as the parameters
are) and calls save_pretrained. Here (collective over the checkpoint's gloo group):

  plan   (foreground, at save time) every rank reports the box (dim-0 rows, or the whole tensor
         when replicated) it holds of each tensor; rank 0 names the tensors as verl's hf_model /
         save_pretrained would (hf.naming.HfSide: tied embeddings, ignored keys, save-time renames,
         and the per-expert tensors transformers 5 splits off an MoE layer's fused experts, each a
         run of its source's elements: `layout.Take`), lays out the files (layout) and assigns every
         box of a source to one holder (export_assign), who writes its part of every output taken
         from that source (`export_assign.take_pieces`: where a box's elements land in an output).
  write  (`direct_write`; after the DCP shards; in async mode on the background thread, from the
         staged copy)
         rank 0 creates the files at full size with their headers, the index and config.json /
         generation_config.json as save_pretrained writes them; then every rank pwrites its
         boxes, cast in chunks of bucket_mb, fsyncs, and all ranks agree on the outcome.

A step saved with verl's save_lora_only holds no base weights: its export is lora_adapter/ alone
(and export_merge_lora is refused in one line).

With `export_merge_lora` a LoRA actor's adapted weights are written merged, W + (B @ A) x alpha / r,
with no gather of W: the writer of a box of W's rows holds B's same rows (FSDP1 and FSDP2 cut W
[out, in] and B [out, r] on dim 0 at the same rows; where a plan finds otherwise, B is all-gathered
too: `b_rows_elsewhere`), A [r, in] is all-gathered, one adapter at a time in the job's order, and
the rows are computed a few at a time by `share_writer.lora_merged`, the arithmetic of `slimckpt
merge --merge_lora`, in the output dtype: the same bits as that merge of the same step.

A rank's extra host memory is one chunk (none when the shard is already on the host in the export
dtype). The files are listed in the step's resume manifest, written after this returns: a
half-written export is never committed. Dtype `auto` keeps the parameters' dtype, which is what
verl's hf_model writes (fp32 master weights -> F32 tensors; config.json says bfloat16, as verl's).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import slimckpt.layout.safetensors_layout as layout
from slimckpt import SlimckptError
from slimckpt.dist.outcome import Failure, from_rank0
from slimckpt.hf import lora
from slimckpt.hf.naming import ConfigMismatch, HfSide, NeedsVerlMerger
from slimckpt.hf.plan import EMPTY, ExportPlan
from slimckpt.internals import dtensor_box
from slimckpt.layout.export_assign import AssignError, Box, assign_writers, full_box, take_pieces
from slimckpt.layout.names import (
    HF_SUBDIR,
    SAFETENSORS_OF_TORCH,
    SHARD_CONTENTS,
    by_torch_dtype,
    is_lora_key,
    torch_dtypes_of_choices,
)
from slimckpt.log import get_logger
from slimckpt.save.os_fixes import trainer_fixes
from slimckpt.save.target import SaveTarget
from slimckpt.storage.os_errors import redescribe

log = get_logger("slimckpt.hf_direct_export")
T = TypeVar("T")

EXPORT_DTYPES: dict[str, torch.dtype | None] = {"auto": None, **torch_dtypes_of_choices(torch)}
ST_DTYPES: dict[torch.dtype, str] = by_torch_dtype(torch, SAFETENSORS_OF_TORCH)
TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in ST_DTYPES.items()}
MERGE_LORA_HINT = "checkpoint.export_merge_lora=true"


class ExportError(SlimckptError, RuntimeError):
    """The export failed; str() is one line (raised the same on every rank)."""


# --------------------------------------------------------------------------- what a rank holds


def box_of(value: Any) -> tuple[tuple[int, ...], torch.dtype, Box | None]:
    """(global shape, dtype, box this rank holds or None) of one state-dict value."""
    if hasattr(value, "to_local") and hasattr(value, "placements"):  # DTensor
        shape = tuple(value.shape)
        local_shape, offset = dtensor_box(value)
        local = value.to_local()
        if tuple(local.shape) != tuple(local_shape):
            raise ExportError(
                f"local shard of shape {tuple(local.shape)} where its placements "
                f"{value.placements} give {tuple(local_shape)}"
            )
        box = Box(tuple(offset), tuple(local_shape))
        return shape, value.dtype, box if box.numel else None
    if hasattr(value, "local_shards") and hasattr(value, "metadata"):  # ShardedTensor (FSDP1 without a mesh)
        shards = value.local_shards()
        if len(shards) > 1:
            raise ExportError(f"{len(shards)} local shards of one ShardedTensor (expected at most one)")
        shape = tuple(value.size())
        dtype = value.metadata().tensor_properties.dtype
        if not shards:
            return shape, dtype, None
        md = shards[0].metadata
        box = Box(tuple(md.shard_offsets), tuple(md.shard_sizes))
        return shape, dtype, box if box.numel else None
    if isinstance(value, torch.Tensor):
        shape = tuple(value.shape)
        return shape, value.dtype, full_box(shape) if value.numel() else None
    raise ExportError(f"state-dict value of type {type(value).__name__} is not a tensor")


def local_shard(value: Any) -> torch.Tensor:
    if hasattr(value, "to_local") and hasattr(value, "placements"):
        return value.to_local()
    if hasattr(value, "local_shards") and hasattr(value, "metadata"):
        return value.local_shards()[0].tensor
    return value


# --------------------------------------------------------------------------- verl's side


def side_contents(target: SaveTarget) -> list[str]:
    """What the caller's own save still writes (verl's: everything but the shards), and no
    `hf_model` gather when the gather-free export replaces it."""
    rest = [c for c in target.save_contents if c not in SHARD_CONTENTS]
    if target.options.export_hf and "hf_model" in rest:
        rest.remove("hf_model")
        if target.state.note_once("hf_model") and target.rank == 0:
            log.info(
                "save_contents has hf_model and export_hf=true: the gather-free export writes huggingface/ "
                "(each rank its own rows); verl's rank-0 gather is skipped"
            )
    return rest


def hf_side(target: SaveTarget, local_path: str):
    """hf.naming.HfSide (names and config files as save_pretrained makes them) from the config verl
    just wrote; kept per target: the model's structure does not change during a run."""
    state = target.state
    if state.hf_side is None:
        # bf16 as verl's hf_model builds its save model; tensors keep their own dtype under 'auto'
        state.hf_side = HfSide(local_path, "bf16", target.trust_remote_code)
    return state.hf_side


def _takes_and_specs(
    target: SaveTarget,
    local_path: str,
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, torch.dtype],
    aliases: dict[str, str],
    export_dtype: str,
):
    """(HfSide, {output name: Take of a state-dict key}, specs), in save_pretrained's order. A LoRA
    actor's base model is named as verl's merger names it (peft's names undone, adapter left out)."""
    side = hf_side(target, local_path)
    all_shapes = dict(shapes)
    for alias, written in aliases.items():  # tied names the DCP state dropped: let HfSide decide
        all_shapes.setdefault(alias, shapes[written])
    renamed = {lora.base_output_name(n): n for n in all_shapes if not is_lora_key(n)}
    if len(renamed) != sum(not is_lora_key(n) for n in all_shapes):
        raise ExportError("two state-dict keys have one name once peft's names are undone")
    try:
        sources = side.output_sources(list(renamed), {new: all_shapes[old] for new, old in renamed.items()})
        sources = {new: layout.Take(renamed[t.source], t.shape, t.span) for new, t in sources.items()}
    except NeedsVerlMerger as exc:
        raise ExportError(
            f"the gather-free export cannot reproduce this model's save: {exc}; set "
            f"checkpoint.export_hf=false and add 'hf_model' to checkpoint.save_contents"
        ) from None
    except ConfigMismatch as exc:
        raise ExportError(str(exc)) from None
    fixed = EXPORT_DTYPES[export_dtype]
    specs, takes = [], {}
    for new, take in sources.items():
        key = aliases.get(take.source, take.source)
        dtype = fixed or dtypes[key]
        if dtype not in ST_DTYPES:
            raise ExportError(f"{take.source}: dtype {dtype} has no safetensors name; set checkpoint.export_dtype=bf16")
        specs.append(layout.TensorSpec(new, ST_DTYPES[dtype], take.shape))
        takes[new] = layout.Take(key, take.shape, take.span)
    return side, takes, specs


def _shares(
    held: list[dict[str, Box]], takes: dict[str, layout.Take], shapes: dict[str, tuple[int, ...]], plan: layout.Plan
) -> list[list[tuple[str, Box]]]:
    """Per rank, the (output name, box of its source) pairs it writes: every box of a source goes to
    one of its holders (assign_writers, balanced by bytes), who writes its part of every output
    taken from that source (none where the box holds none of the output's elements)."""
    outputs: dict[str, list[str]] = {}
    for new, take in takes.items():
        outputs.setdefault(take.source, []).append(new)
    itemsize = {src: max(plan.placements[n].spec.itemsize for n in names) for src, names in outputs.items()}
    assigned = assign_writers(
        [{src: h[src] for src in outputs if src in h} for h in held], {src: shapes[src] for src in outputs}, itemsize
    )
    shares = []
    for pairs in assigned:
        mine = [
            (new, box)
            for src, box in pairs
            for new in outputs[src]
            if takes[new].whole or take_pieces(shapes[src], box, takes[new].span)
        ]
        shares.append(sorted(mine, key=lambda nb: (plan.placements[nb[0]].file, plan.placements[nb[0]].begin)))
    return shares


def b_rows_elsewhere(
    held: list[dict[str, Box]],
    shares: list[list[tuple[str, Box]]],
    takes: dict[str, layout.Take],
    shapes: dict[str, tuple[int, ...]],
) -> frozenset[str]:
    """Merged outputs (export_merge_lora) where some writer of W's rows does not hold all of B's
    [out, r] for those rows: their B is all-gathered like A. FSDP1 and FSDP2 cut every parameter
    on dim 0 into the same world-size chunks, and W [out, in] and B [out, r] have the same dim 0,
    so each rank holds B's rows of its W rows and this is empty for them."""
    out: set[str] = set()
    for rank, pairs in enumerate(shares):
        for name, box in pairs:
            delta = takes[name].delta
            if delta is None or name in out:
                continue
            b_box = held[rank].get(delta.b)
            r0, r1 = box.offset[0], box.offset[0] + box.size[0]
            if (
                b_box is None
                or b_box.offset[1] != 0
                or b_box.size[1] != shapes[delta.b][1]
                or b_box.offset[0] > r0
                or b_box.offset[0] + b_box.size[0] < r1
            ):
                out.add(name)
    return frozenset(out)


# --------------------------------------------------------------------------- plan (collective)


def failure_line(exc: BaseException, local_path: str) -> str:
    """This rank's failure as the line every rank raises: a full or unwritable disk in a trainer's
    words (the export runs inside a save), anything else as it is."""
    line = redescribe(exc, trainer_fixes(local_path))
    if line is not None:
        return line
    return str(exc) if isinstance(exc, (ExportError, OSError, RuntimeError)) else repr(exc)


def on_a_rank(failure: Failure) -> ExportError:
    return ExportError(f"HF export (rank {failure.rank}): {failure.line}")


def plain_outcome(outcome: Callable[[], T]) -> T:
    """`outcome()` (a collective.outcome call), its ExportError raised with no OSError under it: the
    line names the rank and the trainer's fix already, and a failed save describes the OS error
    under an error again (without the rank) where it finds one."""
    try:
        return outcome()
    except ExportError as exc:
        error = exc
    error.__cause__ = error.__context__ = None
    raise error


def _with_adapter(
    target: SaveTarget,
    local_path: str,
    plan: layout.Plan,
    takes: dict[str, layout.Take],
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, torch.dtype],
    export_dtype: str,
    config: Any,
):
    """A LoRA actor's export as verl's merger writes it: `plan` plus lora_adapter/adapter_model.safetensors
    (its tensors added to `takes`), the model's own plan (for the index) and adapter_config.json's text;
    rank and alpha from the live model's peft config, as verl's lora_train_meta.json has them."""
    names = [n for n in shapes if is_lora_key(n)]
    unwrapped = getattr(target.model, "_fsdp_wrapped_module", target.model)
    meta = target.lora_train_meta(unwrapped) if target.lora_train_meta is not None else None
    settings = lora.settings(local_path, names, shapes, meta=meta)
    if config.export_merge_lora:
        try:
            merged = lora.merged_takes(local_path, takes, names, shapes, settings, MERGE_LORA_HINT)
        except lora.MergeError as exc:
            raise ExportError(str(exc)) from None
        if target.state.note_once("merge_lora"):
            log.info(
                "export_merge_lora: %d weights exported as W + B @ A x %s / %d, each rank its own rows "
                "(A all-gathered, no W gathered); no %s/",
                sum(t.delta is not None for t in merged.values()),
                settings.lora_alpha,
                settings.r,
                lora.ADAPTER_DIR,
            )
        return plan, None, None
    fixed = EXPORT_DTYPES[export_dtype]
    specs = []
    for n in names:
        out = lora.adapter_output_name(n)
        if out in takes:
            raise ExportError(f"LoRA tensor {out!r} has a base model tensor's name")
        dtype = fixed or dtypes[n]
        specs.append(layout.TensorSpec(out, ST_DTYPES[dtype], shapes[n]))
        takes[out] = layout.Take(n, shapes[n])
    return lora.with_adapter_files(plan, specs), plan, lora.adapter_config_text(settings)


def plan_export(
    target: SaveTarget, local_path: str, model_state: dict[str, Any], aliases: dict[str, str], config: Any, group
) -> ExportPlan | None:
    """Collective over `group`: this rank's part of the export of `model_state` (the sharded
    state dict the DCP save writes, tied aliases split off) into `local_path/huggingface/`. A LoRA
    actor's is what verl's merger writes: the base model (peft's names undone) and lora_adapter/."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine_held: dict[str, Box] = {}
    meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    error = ""
    try:
        for name, value in model_state.items():
            shape, dtype, box = box_of(value)
            meta[name] = (shape, dtype)
            if box is not None:
                mine_held[name] = box
    except ExportError as exc:
        error = f"{name}: {exc}"
    held: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object((mine_held, error), held, dst=dist.get_global_rank(group, 0), group=group)

    def plan_on_rank0() -> tuple[ExportPlan, list[list[tuple[str, Box]]], dict, frozenset[str]]:
        errors = [e for _, e in held if e]
        if errors:
            raise ExportError(errors[0])
        shapes = {n: s for n, (s, _) in meta.items()}
        dtypes = {n: d for n, (_, d) in meta.items()}
        export_dtype = str(config.export_dtype)
        if shapes and all(is_lora_key(n) for n in shapes):  # save_lora_only: the adapter alone
            if config.export_merge_lora:
                raise ExportError(
                    f"{MERGE_LORA_HINT} with save_lora_only=true: the step holds no base weights "
                    f"to merge the adapter into; set export_merge_lora=false (the export is then "
                    f"lora_adapter/ alone) or save_lora_only=false"
                )
            side, takes, plan = hf_side(target, local_path), {}, EMPTY
        else:
            side, takes, specs = _takes_and_specs(target, local_path, shapes, dtypes, aliases, export_dtype)
            plan = layout.plan_files(specs, config.max_shard_size)
        index_plan, adapter_config = None, None
        if any(is_lora_key(n) for n in shapes):
            plan, index_plan, adapter_config = _with_adapter(
                target, local_path, plan, takes, shapes, dtypes, export_dtype, config
            )
        for take in takes.values():
            take.check_source(shapes[take.source])
        holders = [h for h, _ in held]
        shares = _shares(holders, takes, shapes, plan)
        used = {take.source: shapes[take.source] for take in takes.values()}
        for take in takes.values():
            if take.delta is not None:
                used.update({n: shapes[n] for n in (take.delta.a, take.delta.b)})
        whole = ExportPlan(plan, takes, side.total_parameters(), index_plan, adapter_config)
        return whole, shares, used, b_rows_elsewhere(holders, shares, takes, shapes)

    def said(exc: BaseException) -> str:
        return (
            str(exc)
            if isinstance(exc, (ExportError, AssignError, layout.LayoutError))
            else f"{type(exc).__name__}: {exc}"
        )

    whole, shares, used, gather_b = plain_outcome(
        lambda: from_rank0(
            group, plan_on_rank0, lambda failure: ExportError(f"HF export of {local_path}: {failure.line}"), said
        )
    )
    return whole.with_share(shares[rank], used, gather_b)


def export_files(local_path: str) -> list[str]:
    """Every file under `huggingface/` (configs, tokenizer, weights, index), relative to
    local_path: rank 0 lists them in the step's manifest."""
    hf_dir = os.path.join(local_path, HF_SUBDIR)
    if not os.path.isdir(hf_dir):
        return []
    return sorted(
        os.path.relpath(os.path.join(root, n), local_path) for root, _, names in os.walk(hf_dir) for n in names
    )
