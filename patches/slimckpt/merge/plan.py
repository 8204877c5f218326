"""What a merge is asked to do and what it did: options and result, and the error a user can act
on. Shared by the merge's pipeline, its writer processes and its two front ends (the CLI and
verl's redirected merger); what it will write is a `hf.plan.ExportPlan`."""

from __future__ import annotations

from dataclasses import dataclass, field

from slimckpt.hf.plan import MergeError
from slimckpt.layout.names import DEFAULT_CHUNK_BYTES
from slimckpt.storage.os_errors import MERGE_FIXES, OsErrorFixes

__all__ = ["MergeError", "MergeOptions", "MergeResult"]


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
    # source bytes per chunk; a writer holds 2 cast buffers of the output's size (out_files.StagingRing)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
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
    # the source's checksums were checked already (a step fetched from a remote medium: read.remote_step)
    source_checked: bool = False
    # what the output's manifest calls the source (a fetched step: its URL, not the scratch mirror)
    source_name: str | None = None
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
