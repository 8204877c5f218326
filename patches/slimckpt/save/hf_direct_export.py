"""Gather-free HF export of the incremental tier: every rank writes its own rows of each
parameter straight into `<step>/<role>/huggingface/*.safetensors` at their planned offsets.

verl's `hf_model` save gathers the whole model into rank 0's host RAM (fp32, as the parameters
are) and calls save_pretrained. Here (collective over the checkpoint's gloo group):

  plan   (foreground, at save time) every rank reports the box (dim-0 rows, or the whole tensor
         when replicated) it holds of each tensor; rank 0 names the tensors as verl's hf_model /
         save_pretrained would (hf_side.HfSide: tied embeddings, ignored keys, save-time renames,
         and the per-expert tensors transformers 5 splits off an MoE layer's fused experts, each a
         run of its source's elements: `layout.Take`), lays out the files (layout) and assigns every
         box of a source to one holder (export_assign), who writes its part of every output taken
         from that source (`export_assign.take_pieces`: where a box's elements land in an output).
  write  (after the DCP shards; in async mode on the background thread, from the staged copy)
         rank 0 creates the files at full size with their headers, the index and config.json /
         generation_config.json as save_pretrained writes them; then every rank pwrites its
         boxes, cast in chunks of bucket_mb, fsyncs, and all ranks agree on the outcome.

A rank's extra host memory is one chunk (none when the shard is already on the host in the export
dtype). The files are listed in the step's resume manifest, written after this returns: a
half-written export is never committed. Dtype `auto` keeps the parameters' dtype, which is what
verl's hf_model writes (fp32 master weights -> F32 tensors; config.json says bfloat16, as verl's).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..format import layout
from ..format.export_assign import AssignError, Box, assign_writers, full_box, run_starts, take_pieces
from ..log import get_logger

log = get_logger("slimckpt.hf_direct_export")

HF_SUBDIR = "huggingface"
EXPORT_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ST_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPES = {v: k for k, v in ST_DTYPES.items()}


class ExportError(RuntimeError):
    """The export failed; str() is one line (raised the same on every rank)."""


@dataclass
class ExportJob:
    """What this rank needs to write its part: the file plan, where each output comes from, and its
    (output name, box of the output's source) list."""

    plan: layout.Plan
    takes: dict[str, layout.Take]  # output name -> the state-dict key (or the run of its elements) it is
    mine: list[tuple[str, Box]]
    source_shapes: dict[str, tuple[int, ...]]  # state-dict key -> global shape
    total_parameters: int | None = None
    # a LoRA actor: `plan` holds lora_adapter/adapter_model.safetensors too, `index_plan` the model's
    # files only; `adapter_config` is lora_adapter/adapter_config.json's text (as verl's merger writes)
    index_plan: layout.Plan | None = None
    adapter_config: str | None = None

    @property
    def name_map(self) -> dict[str, str]:
        """Output name -> the state-dict key it reads."""
        return {new: take.source for new, take in self.takes.items()}


# --------------------------------------------------------------------------- what a rank holds


def _box_of(value: Any) -> tuple[tuple[int, ...], torch.dtype, Box | None]:
    """(global shape, dtype, box this rank holds or None) of one state-dict value."""
    if hasattr(value, "to_local") and hasattr(value, "placements"):  # DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape = tuple(value.shape)
        local_shape, offset = compute_local_shape_and_global_offset(shape, value.device_mesh, value.placements)
        local = value.to_local()
        if tuple(local.shape) != tuple(local_shape):
            raise ExportError(f"local shard of shape {tuple(local.shape)} where its placements "
                              f"{value.placements} give {tuple(local_shape)}")
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


def _local(value: Any) -> torch.Tensor:
    if hasattr(value, "to_local") and hasattr(value, "placements"):
        return value.to_local()
    if hasattr(value, "local_shards") and hasattr(value, "metadata"):
        return value.local_shards()[0].tensor
    return value


# --------------------------------------------------------------------------- verl's side


def verl_contents(manager, config: Any) -> list[str]:
    """What verl's own save still writes: everything but the shards, and no `hf_model` gather
    when the gather-free export replaces it."""
    rest = [c for c in manager.checkpoint_save_contents if c not in ("model", "optimizer", "extra")]
    if getattr(config, "export_hf", False) and "hf_model" in rest:
        rest.remove("hf_model")
        if manager.rank == 0 and not getattr(manager, "_slimckpt_hf_model_noted", False):
            log.info("save_contents has hf_model and export_hf=true: the gather-free export writes huggingface/ "
                     "(each rank its own rows); verl's rank-0 gather is skipped")
        manager._slimckpt_hf_model_noted = True
    return rest


def _hf_side(manager, local_path: str):
    """hf_side.HfSide (names and config files as save_pretrained makes them) from the config verl
    just wrote; kept per manager: the model's structure does not change during a run."""
    from ..merge.hf_side import HfSide

    side = getattr(manager, "_slimckpt_hf_side", None)
    if side is None:
        # bf16 as verl's hf_model builds its save model; tensors keep their own dtype under 'auto'
        side = HfSide(local_path, "bf16", bool(getattr(manager, "trust_remote_code", False)))
        manager._slimckpt_hf_side = side
    return side


def _takes_and_specs(manager, local_path: str, shapes: dict[str, tuple[int, ...]],
                     dtypes: dict[str, torch.dtype], aliases: dict[str, str], export_dtype: str):
    """(HfSide, {output name: Take of a state-dict key}, specs), in save_pretrained's order. A LoRA
    actor's base model is named as verl's merger names it (peft's names undone, adapter left out)."""
    from ..merge.hf_side import ConfigMismatch, NeedsVerlMerger
    from ..merge.lora import base_output_name, is_lora

    side = _hf_side(manager, local_path)
    all_shapes = dict(shapes)
    for alias, target in aliases.items():  # tied names the DCP state dropped: let HfSide decide
        all_shapes.setdefault(alias, shapes[target])
    renamed = {base_output_name(n): n for n in all_shapes if not is_lora(n)}
    if len(renamed) != sum(not is_lora(n) for n in all_shapes):
        raise ExportError("two state-dict keys have one name once peft's names are undone")
    try:
        sources = side.output_sources(list(renamed), {new: all_shapes[old] for new, old in renamed.items()})
        sources = {new: layout.Take(renamed[t.source], t.shape, t.span) for new, t in sources.items()}
    except NeedsVerlMerger as exc:
        raise ExportError(f"the gather-free export cannot reproduce this model's save: {exc}; set "
                          f"checkpoint.export_hf=false and add 'hf_model' to checkpoint.save_contents") from None
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


def _shares(held: list[dict[str, Box]], takes: dict[str, layout.Take], shapes: dict[str, tuple[int, ...]],
            plan: layout.Plan) -> list[list[tuple[str, Box]]]:
    """Per rank, the (output name, box of its source) pairs it writes: every box of a source goes to
    one of its holders (assign_writers, balanced by bytes), who writes its part of every output
    taken from that source (none where the box holds none of the output's elements)."""
    outputs: dict[str, list[str]] = {}
    for new, take in takes.items():
        outputs.setdefault(take.source, []).append(new)
    itemsize = {src: max(plan.placements[n].spec.itemsize for n in names) for src, names in outputs.items()}
    assigned = assign_writers([{src: h[src] for src in outputs if src in h} for h in held],
                              {src: shapes[src] for src in outputs}, itemsize)
    shares = []
    for pairs in assigned:
        mine = [(new, box) for src, box in pairs for new in outputs[src]
                if takes[new].whole or take_pieces(shapes[src], box, takes[new].span)]
        shares.append(sorted(mine, key=lambda nb: (plan.placements[nb[0]].file, plan.placements[nb[0]].begin)))
    return shares


# --------------------------------------------------------------------------- plan (collective)


def _collective_outcome(group, ok: bool, message: str) -> None:
    """Every rank raises the first failure any rank had."""
    outcomes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, (ok, message), group=group)
    for rank, (good, text) in enumerate(outcomes):
        if not good:
            raise ExportError(f"HF export (rank {rank}): {text}")


def _is_lora(name: str) -> bool:
    from ..merge.lora import is_lora

    return is_lora(name)


def _with_adapter(manager, local_path: str, plan: layout.Plan, takes: dict[str, layout.Take],
                  shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype], export_dtype: str, config: Any):
    """A LoRA actor's export as verl's merger writes it: `plan` plus lora_adapter/adapter_model.safetensors
    (its tensors added to `takes`), the model's own plan (for the index) and adapter_config.json's text;
    rank and alpha from the live model's peft config, as verl's lora_train_meta.json has them."""
    from ..merge import lora

    names = [n for n in shapes if lora.is_lora(n)]
    unwrapped = getattr(manager.model, "_fsdp_wrapped_module", manager.model)
    meta = manager._get_lora_train_meta(unwrapped) if hasattr(manager, "_get_lora_train_meta") else None
    settings = lora.settings(local_path, names, shapes, meta=meta)
    if getattr(config, "export_merge_lora", False) and not getattr(manager, "_slimckpt_merge_lora_noted", False):
        manager._slimckpt_merge_lora_noted = True
        log.warning("checkpoint.export_merge_lora=true: the incremental tier's gather-free export writes the base "
                    "model and lora_adapter/ unmerged; merge them with `slimckpt merge --merge_lora` (or use "
                    "+recipe=intermediate, whose export merges)")
    fixed = EXPORT_DTYPES[export_dtype]
    specs = []
    for n in names:
        out = lora.adapter_output_name(n)
        if out in takes:
            raise ExportError(f"LoRA tensor {out!r} has a base model tensor's name")
        dtype = fixed or dtypes[n]
        specs.append(layout.TensorSpec(out, ST_DTYPES[dtype], shapes[n]))
        takes[out] = layout.Take(n, shapes[n])
    adapter = layout.plan_files(specs, lora.ONE_FILE, metadata=None, pattern=lora.ADAPTER_WEIGHTS_PATTERN)
    both = layout.Plan(files=plan.files + adapter.files, total_size=plan.total_size + adapter.total_size,
                       placements={**plan.placements, **adapter.placements})
    return both, plan, lora.adapter_config_text(settings)


def plan_export(manager, local_path: str, model_state: dict[str, Any], aliases: dict[str, str], config: Any,
                group) -> ExportJob | None:
    """Collective over `group`: this rank's part of the export of `model_state` (the sharded
    state dict the DCP save writes, tied aliases split off) into `local_path/huggingface/`. A LoRA
    actor's is what verl's merger writes: the base model (peft's names undone) and lora_adapter/."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine_held: dict[str, Box] = {}
    meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    error = ""
    try:
        for name, value in model_state.items():
            shape, dtype, box = _box_of(value)
            meta[name] = (shape, dtype)
            if box is not None:
                mine_held[name] = box
    except ExportError as exc:
        error = f"{name}: {exc}"
    held: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object((mine_held, error), held, dst=dist.get_global_rank(group, 0), group=group)

    payload: list[Any] = [None] * world
    if rank == 0:
        try:
            errors = [e for _, e in held if e]
            if errors:
                raise ExportError(errors[0])
            shapes = {n: s for n, (s, _) in meta.items()}
            dtypes = {n: d for n, (_, d) in meta.items()}
            export_dtype = str(getattr(config, "export_dtype", "auto"))
            side, takes, specs = _takes_and_specs(manager, local_path, shapes, dtypes, aliases, export_dtype)
            plan = layout.plan_files(specs, getattr(config, "max_shard_size", "5GB"))
            index_plan, adapter_config = None, None
            if any(_is_lora(n) for n in shapes):
                plan, index_plan, adapter_config = _with_adapter(manager, local_path, plan, takes, shapes, dtypes,
                                                                 export_dtype, config)
            for take in takes.values():
                take.check_source(shapes[take.source])
            shares = _shares([h for h, _ in held], takes, shapes, plan)
            total = side.total_parameters()
            used = {take.source: shapes[take.source] for take in takes.values()}
            payload = [("ok", ExportJob(plan, takes, share, used, total, index_plan, adapter_config))
                       for share in shares]
        except (ExportError, AssignError, layout.LayoutError) as exc:
            payload = [("error", str(exc))] * world
        except Exception as exc:  # noqa: BLE001 - every rank must hear about it
            payload = [("error", f"{type(exc).__name__}: {exc}")] * world
    box: list[Any] = [None]
    dist.scatter_object_list(box, payload if rank == 0 else None, src=dist.get_global_rank(group, 0), group=group)
    status, job = box[0]
    if status != "ok":
        raise ExportError(f"HF export of {local_path}: {job}")
    return job


# --------------------------------------------------------------------------- write (collective)


def _clear_old_weights(hf_dir: str) -> None:
    """Weight files and index of an earlier attempt (their split may differ from this plan's)."""
    for name in os.listdir(hf_dir):
        if (name.startswith("model") and name.endswith(".safetensors")) or name == layout.INDEX_NAME:
            os.remove(os.path.join(hf_dir, name))
    adapter_dir = os.path.join(hf_dir, "lora_adapter")
    if os.path.isdir(adapter_dir):
        for name in os.listdir(adapter_dir):
            if name.startswith("adapter_"):
                os.remove(os.path.join(adapter_dir, name))


def _lay_out(job: ExportJob, local_path: str, manager) -> None:
    """Rank 0: configs as save_pretrained writes them, full-size files with headers, the index."""
    from ..write.out_files import create_files

    hf_dir = os.path.join(local_path, HF_SUBDIR)
    os.makedirs(hf_dir, exist_ok=True)
    _clear_old_weights(hf_dir)
    _hf_side(manager, local_path).save_configs(hf_dir)
    if job.adapter_config is not None:
        from ..merge.lora import write_adapter_config

        write_adapter_config(hf_dir, job.adapter_config)
    create_files(hf_dir, job.plan)
    index = (job.index_plan or job.plan).index_json(job.total_parameters)
    if index is not None:
        with open(os.path.join(hf_dir, layout.INDEX_NAME), "w", encoding="utf-8") as f:
            f.write(index)
            f.flush()
            os.fsync(f.fileno())


class _BoxWriter:
    """This rank's boxes into the planned files: chunked cast into one reused host buffer."""

    def __init__(self, hf_dir: str, plan: layout.Plan, chunk_bytes: int) -> None:
        self.hf_dir, self.plan = hf_dir, plan
        self.chunk_bytes = max(1 << 16, chunk_bytes)
        self._fds: dict[str, int] = {}
        self._buffer: torch.Tensor | None = None
        self._starts: dict[tuple[str, Box], list[int]] = {}

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            from ..write.out_files import OutputError

            path = os.path.join(self.hf_dir, name)
            try:
                fd = self._fds[name] = os.open(path, os.O_WRONLY)
            except OSError as exc:
                from ..format.merge_manifest import describe_os_error

                raise OutputError(describe_os_error(exc, path)) from None
        return fd

    def _staged(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`src` (1-d) in `dtype` on the host: itself when it already is, else a view of the buffer."""
        if src.device.type == "cpu" and src.dtype == dtype and src.is_contiguous():
            return src
        nbytes = src.numel() * dtype.itemsize
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(max(nbytes, self.chunk_bytes), dtype=torch.uint8)
        out = self._buffer[:nbytes].view(dtype)
        out.copy_(src)
        return out

    def write_box(self, out_name: str, value: Any, box: Box, take: layout.Take,
                  source_shape: tuple[int, ...]) -> int:
        """This rank's part of output `out_name`: the elements of its box of the source (`value`,
        its local shard) that the output takes, each piece cast in chunks and pwritten in place."""
        from ..write.out_files import OutputError, pwrite_all
        from ..write.share_writer import as_bytes

        placement = self.plan.placements[out_name]
        spec = placement.spec
        dtype = TORCH_DTYPES[spec.dtype]
        local = _local(value)
        if tuple(local.shape) != box.size:
            raise ExportError(f"{out_name}: local shard shape {tuple(local.shape)} != planned {box.size}")
        starts = self._starts.get((take.source, box))
        if starts is None:  # outputs split off one source share its box's runs
            starts = self._starts[(take.source, box)] = run_starts(source_shape, box)
        # contiguous shards (FSDP's, staged copies) are viewed, not copied
        flat = local.reshape(-1)
        per_chunk = max(1, self.chunk_bytes // max(spec.itemsize, local.element_size()))
        fd = self._fd(placement.file)
        written = 0
        for piece in take_pieces(source_shape, box, take.span, starts):
            offset = placement.begin + piece.out_start * spec.itemsize
            for a in range(piece.local_start, piece.local_end, per_chunk):
                chunk = self._staged(flat[a:min(piece.local_end, a + per_chunk)], dtype)
                data = as_bytes(chunk)
                try:
                    pwrite_all(fd, data, offset)
                except OSError as exc:
                    from ..format.merge_manifest import describe_os_error

                    raise OutputError(describe_os_error(exc, os.path.join(self.hf_dir, placement.file),
                                                       self.plan.total_size)) from None
                offset += len(data)
                written += len(data)
        return written

    def close(self, sync: bool) -> None:
        first: BaseException | None = None
        for fd in self._fds.values():
            try:
                if sync:
                    os.fsync(fd)
            except OSError as exc:
                first = first or exc
            finally:
                os.close(fd)
        self._fds.clear()
        self._buffer = None
        self._starts.clear()
        if first is not None:
            raise first


def sources_read(job: ExportJob) -> list[str]:
    """The model tensors this rank's part of the export reads, once per box it writes."""
    return [job.takes[out_name].source for out_name, _ in job.mine]


def write_export(manager, job: ExportJob, local_path: str, model_state: dict[str, Any], config: Any,
                 group, reads: Any = None) -> int:
    """Collective over `group`: rank 0 lays the files out, every rank writes its boxes from
    `model_state` (live shards in sync mode, the staged copy in pool mode), fsyncs, and all
    ranks raise the same error if any failed. Returns the bytes this rank wrote. `reads`
    (stream mode, stream_capture.StreamReads) hands out each box's source and is told when the
    box is written."""
    rank = dist.get_rank(group)
    ok, message = True, ""
    if rank == 0:
        try:
            _lay_out(job, local_path, manager)
        except Exception as exc:  # noqa: BLE001
            ok, message = False, str(exc) if isinstance(exc, (ExportError, OSError, RuntimeError)) else repr(exc)
    _collective_outcome(group, ok, message)

    writer = _BoxWriter(os.path.join(local_path, HF_SUBDIR), job.plan,
                        int(getattr(config, "bucket_mb", 64)) << 20)
    written = 0
    ok, message = True, ""
    try:
        for out_name, box in job.mine:
            take = job.takes[out_name]
            value = reads.begin(take.source) if reads is not None else model_state[take.source]
            written += writer.write_box(out_name, value, box, take, job.source_shapes[take.source])
            if reads is not None:
                reads.end(take.source)
        writer.close(sync=True)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        with contextlib.suppress(Exception):
            writer.close(sync=False)
        ok, message = False, str(exc) if isinstance(exc, (ExportError, OSError, RuntimeError)) else repr(exc)
    _collective_outcome(group, ok, message)
    if rank == 0:
        with contextlib.suppress(OSError):  # the directory entries of the new files
            fd = os.open(os.path.join(local_path, HF_SUBDIR), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        log.info("HF export %s: %d tensors, %.1f MiB in %d file(s), written in place by %d rank(s), no gather",
                 os.path.join(local_path, HF_SUBDIR), len(job.plan.placements), job.plan.total_size / 2**20,
                 len(job.plan.files), dist.get_world_size(group))
    return written



def export_files(local_path: str) -> list[str]:
    """Every file under `huggingface/` (configs, tokenizer, weights, index), relative to
    local_path: rank 0 lists them in the step's manifest."""
    hf_dir = os.path.join(local_path, HF_SUBDIR)
    if not os.path.isdir(hf_dir):
        return []
    return sorted(os.path.relpath(os.path.join(root, n), local_path)
                  for root, _, names in os.walk(hf_dir) for n in names)
