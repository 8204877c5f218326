"""The plan of a Hugging Face export: which output names come from which checkpoint tensors (or
runs of their elements), laid out as safetensors files. `slimckpt merge` (from rank files or
dcp/) and the incremental tier's gather-free export build the same `ExportPlan`; the export adds
each rank's share of the writing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import slimckpt.layout.safetensors_layout as layout
from slimckpt import SlimckptError
from slimckpt.engine.checkpoint_dir import CheckpointError
from slimckpt.engine.output_dir import check_room
from slimckpt.hf.naming import ConfigMismatch, HfSide
from slimckpt.layout.export_assign import Box
from slimckpt.layout.names import DTYPE_CHOICES, HF_SUBDIR


class MergeError(SlimckptError, RuntimeError):
    """Any failure of a merge or export plan a user can act on; str() is the one-line message."""


@dataclass
class ExportPlan:
    plan: layout.Plan
    takes: dict[str, layout.Take]  # output name -> the checkpoint tensor (or the part of one) it is
    total_parameters: int | None
    # a LoRA checkpoint's unmerged output: `plan` holds lora_adapter/adapter_model.safetensors too,
    # `index_plan` the model's files only (model.safetensors.index.json, the manifest's weight_files);
    # `adapter_config` is lora_adapter/adapter_config.json's text
    index_plan: layout.Plan | None = None
    adapter_config: str | None = None
    # the checkpoint it reads, for the merge manifest
    world_size: int | None = None
    fsdp_version: int | None = None
    source_format: str = "verl_fsdp"  # VerlFsdpCheckpoint.source_format
    # the in-training export: this rank's (output name, box of the output's source) list, the
    # sources' global shapes, and the merged outputs whose B is all-gathered like A because a
    # writer of W's rows does not hold B's same rows (never with FSDP1/FSDP2, which cut W and B on
    # dim 0 at the same rows)
    mine: list[tuple[str, Box]] = field(default_factory=list)
    source_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    gather_b: frozenset[str] = frozenset()

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

    @property
    def merged_outputs(self) -> list[str]:
        """Outputs written as W + B @ A x alpha / r, in one order on every rank (the export
        all-gathers each one's A in that order)."""
        return [n for n, t in self.takes.items() if t.delta is not None]

    def with_share(
        self, mine: list[tuple[str, Box]], source_shapes: dict[str, tuple[int, ...]], gather_b: frozenset[str]
    ) -> ExportPlan:
        """This plan with one rank's share of the writing."""
        return ExportPlan(
            self.plan,
            self.takes,
            self.total_parameters,
            self.index_plan,
            self.adapter_config,
            self.world_size,
            self.fsdp_version,
            self.source_format,
            mine,
            source_shapes,
            gather_b,
        )


EMPTY = layout.Plan(files=(), total_size=0, placements={})


def check_output_room(local_dir: str, target: str, mp: ExportPlan) -> None:
    """Refuse, before anything is written, an output the target's filesystem cannot hold: the planned
    weight files plus what is copied beside them (the checkpoint's huggingface/ dir: configs, tokenizer)."""
    side = 0
    for root, _dirs, files in os.walk(os.path.join(local_dir, HF_SUBDIR)):
        for name in files:
            try:
                side += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    check_room(target, mp.weight_bytes + side)


def make_plan(ckpt: Any, hf: HfSide, dtype: str, max_shard_size) -> ExportPlan:
    try:
        takes = hf.output_sources(list(ckpt.tensors), {n: t.shape for n, t in ckpt.tensors.items()})
    except ConfigMismatch as exc:  # one line naming the tensor, the rank file and the config
        raise CheckpointError(f"{ckpt.tensors[exc.name].file_of(0)}: {exc}") from None
    return plan_takes(ckpt, takes, dtype, max_shard_size, hf.total_parameters())


def plan_names(ckpt: Any, name_map: dict[str, str], dtype: str, max_shard_size, total_parameters: int) -> ExportPlan:
    """The plan of outputs that are whole checkpoint tensors ({output name: checkpoint name})."""
    takes = {new: layout.Take(old, tuple(ckpt.tensors[old].shape)) for new, old in name_map.items()}
    return plan_takes(ckpt, takes, dtype, max_shard_size, total_parameters)


def plan_takes(
    ckpt: Any, takes: dict[str, layout.Take], dtype: str, max_shard_size, total_parameters: int
) -> ExportPlan:
    st_dtype = DTYPE_CHOICES[dtype]
    for take in takes.values():
        take.check_source(ckpt.tensors[take.source].shape)
    specs = [layout.TensorSpec(new, st_dtype, take.shape) for new, take in takes.items()]
    plan = layout.plan_files(specs, max_shard_size)
    return ExportPlan(
        plan,
        takes,
        total_parameters,
        world_size=ckpt.world_size,
        fsdp_version=ckpt.fsdp_version,
        source_format=getattr(ckpt, "source_format", "verl_fsdp"),
    )
