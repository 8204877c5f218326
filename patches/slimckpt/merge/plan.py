"""What a merge is asked to do and what it will write: options, the plan (output names -> the
safetensors layout), the result and the error a user can act on. Shared by the merge's pipeline, its
writer processes and its two front ends (the CLI and verl's redirected merger)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..format import layout
from ..format.os_errors import MERGE_FIXES, OsErrorFixes

if TYPE_CHECKING:
    from .hf_side import HfSide

DTYPE_NAMES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
# Larger O_DIRECT reads than a few MiB are slower (the kernel splits requests), and per chunk the cast
# costs Python calls, so below 1 MiB the CPU loses it again: 2 MiB merged fastest
# (measured: BENCHMARKS.md, Figures quoted in the code)
DEFAULT_CHUNK_MB = 2


class MergeError(RuntimeError):
    """Any failure a user can act on; str() is the one-line message."""


@dataclass
class MergeOptions:
    local_dir: str
    target_dir: str
    dtype: str = "bf16"
    max_shard_size: int | str | None = None  # None: transformers' save_pretrained default
    workers: int = 1
    distributed: bool = False
    overwrite: bool = False
    trust_remote_code: bool = False
    progress: bool = True
    # source bytes per chunk; a writer holds 2 read buffers (direct_read) and 2 cast buffers of the output's size
    chunk_bytes: int = DEFAULT_CHUNK_MB << 20
    fsync: bool = True  # False: --no_fsync, faster but the output may be lost or torn by a power loss
    overwrite_hint: str = "--overwrite"
    distributed_hint: str = "--distributed_merge"  # what asked for `distributed`, for its error lines
    lock_source: bool = True  # shared lock on local_dir while reading it (the trainer's export holds its own)
    # False: a checkpoint the streaming merge cannot reproduce (a save-time conversion that is
    # not one run of one checkpoint tensor) is refused in one line instead of going to verl's merger,
    # which holds the whole model in host memory; `verl_fallback_hint` is what asked for that
    verl_fallback: bool = True
    verl_fallback_hint: str = "--no_verl_fallback"
    # a LoRA checkpoint: False writes what verl's merger does (the base model, and lora_adapter/ with
    # the adapter); True writes W + (B @ A) * lora_alpha / r into the base weights, no lora_adapter/
    merge_lora: bool = False
    merge_lora_hint: str = "--merge_lora"
    # a LoRA-only checkpoint (verl's save_lora_only): True writes lora_adapter/ alone (the in-training
    # export: the base is model.path's); False refuses it (a merge makes a model, and there is no base)
    adapter_only: bool = False
    # a full or unwritable output, in the words of whoever asked for it (the in-training export: a trainer's)
    os_fixes: OsErrorFixes = MERGE_FIXES


@dataclass
class MergeResult:
    target_dir: str
    files: list[str] = field(default_factory=list)
    weight_bytes: int = 0
    seconds: float = 0.0
    used_verl_merger: bool = False
    tokenizer_saved: bool = False


@dataclass
class MergePlan:
    plan: layout.Plan
    takes: dict[str, layout.Take]  # output name -> the checkpoint tensor (or the part of one) it is
    total_parameters: int
    world_size: int
    fsdp_version: int | None
    # a LoRA checkpoint's unmerged output: `plan` holds lora_adapter/adapter_model.safetensors too,
    # `index_plan` the model's files only (model.safetensors.index.json, the manifest's weight_files);
    # `adapter_config` is lora_adapter/adapter_config.json's text
    index_plan: layout.Plan | None = None
    adapter_config: str | None = None
    source_format: str = "verl_fsdp"  # VerlFsdpCheckpoint.source_format, for the merge manifest

    @property
    def model_plan(self) -> layout.Plan:
        """The model's weight files (without a LoRA adapter's)."""
        return self.index_plan if self.index_plan is not None else self.plan

    @property
    def name_map(self) -> dict[str, str]:
        """Output name -> the checkpoint name it reads."""
        return {new: take.source for new, take in self.takes.items()}

    @property
    def weight_bytes(self) -> int:
        return sum(f.size for f in self.plan.files)


def check_output_room(local_dir: str, target: str, mp: MergePlan) -> None:
    """Refuse, before anything is written, an output the target's filesystem cannot hold: the planned
    weight files plus what is copied beside them (the checkpoint's huggingface/ dir: configs, tokenizer)."""
    import os

    from ..format.merge_manifest import check_room
    from ..read.checkpoint_dir import HF_SUBDIR

    side = 0
    for root, _dirs, files in os.walk(os.path.join(local_dir, HF_SUBDIR)):
        for name in files:
            try:
                side += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    check_room(target, mp.weight_bytes + side)


def make_plan(ckpt, hf: "HfSide", dtype: str, max_shard_size) -> MergePlan:
    from ..read.checkpoint_dir import CheckpointError
    from .hf_side import ConfigMismatch

    try:
        takes = hf.output_sources(list(ckpt.tensors), {n: t.shape for n, t in ckpt.tensors.items()})
    except ConfigMismatch as exc:  # one line naming the tensor, the rank file and the config
        raise CheckpointError(f"{ckpt.tensors[exc.name].file_of(0)}: {exc}") from None
    return plan_takes(ckpt, takes, dtype, max_shard_size, hf.total_parameters())


def plan_names(ckpt, name_map: dict[str, str], dtype: str, max_shard_size, total_parameters: int) -> MergePlan:
    """The plan of outputs that are whole checkpoint tensors ({output name: checkpoint name})."""
    takes = {new: layout.Take(old, tuple(ckpt.tensors[old].shape)) for new, old in name_map.items()}
    return plan_takes(ckpt, takes, dtype, max_shard_size, total_parameters)


def plan_takes(ckpt, takes: dict[str, layout.Take], dtype: str, max_shard_size, total_parameters: int) -> MergePlan:
    st_dtype = DTYPE_NAMES[dtype]
    for take in takes.values():
        take.check_source(ckpt.tensors[take.source].shape)
    specs = [layout.TensorSpec(new, st_dtype, take.shape) for new, take in takes.items()]
    plan = layout.plan_files(specs, max_shard_size)
    return MergePlan(plan, takes, total_parameters, ckpt.world_size, ckpt.fsdp_version,
                     source_format=getattr(ckpt, "source_format", "verl_fsdp"))
