"""`slimckpt plan`: what a checkpoint will cost, per rank, before a GPU is allocated.

    slimckpt plan --config path/to/config.json --world-size 64 [--recipe incremental] [--disk-gbps 2]
                  [--max-actor-ckpt-to-keep 2] [--max-critic-ckpt-to-keep 2 --critic]
    python -m slimckpt.plan ...   (the same)

From the model config alone (a meta-device model: shapes, no weights) it prints, for verl's
default save, verl's save with `hf_model`, and each slimckpt recipe: the bytes each rank writes
(fp32 model shard, AdamW's two fp32 moments, extra state), the host memory a rank needs for the
save, the time at the given aggregate disk bandwidth, and how long training is blocked; then the
Hugging Face export's file layout (planned by slimckpt.format.layout, as the merger writes it).

The arithmetic (pure functions below, unit-tested): FSDP shards every parameter along dim 0 in
chunks of ceil(rows / W) rows (torch.chunk, as FSDP2 does), so rank 0 holds the most. verl keeps
fp32 master weights; AdamW keeps exp_avg and exp_avg_sq (fp32, the parameter's shape) and a 4-byte
step per parameter. Host memory models each path on accelerators: verl's save hands device
tensors to torch.save, which copies them to host one storage at a time, except that with FSDP1
(verl's default strategy) the model's sharded state dict is taken with offload_to_cpu=True, so the
rank's whole model shard is in host RAM at once; its hf_model save gathers the whole fp32 model on
rank 0. The incremental tier streams (write_threads x (bucket_mb + the largest tensor shard)) or,
async, stages the rank's shards once within host_memory_budget_gb; with FSDP1 its reshardable
state dict costs a transient copy of the rank's shards on the accelerator. File-format overhead
(headers, pickles) is not counted.

Then the peak disk of the run: a role's bytes per step times the steps it holds while a new one is
written, under verl's retention order and slimckpt's (slimckpt.save.retention.peak_steps: one step
more, since it deletes only once the new step is complete), at trainer.max_actor_ckpt_to_keep /
max_critic_ckpt_to_keep (as given; else each row's own: a recipe's value, verl's null = keep all).
With a recipe's keep_optimizer_last / keep_best (`--set keep_optimizer_last=1 --set keep_best=2`)
a second table splits the steps held into whole ones and ones without their optimizer state
(slimckpt.format.retention_plan.steps_held), next to the same retention with the optimizer in
every kept step and with keep_optimizer_last=1.
The critic (`--critic`, PPO with GAE) is the actor's shapes with a one-output value head instead
of lm_head, saving the same contents and no Hugging Face export.

A LoRA actor (`--lora-rank R`, with verl's lora_alpha / target_modules / exclude_modules /
target_parameters keys) is wrapped as verl wraps it, by peft on the meta model: the base model is
frozen (in the model shards, no AdamW state), the adapter trained in fp32; the HF export is the base
model plus lora_adapter/ (as verl's merger writes it). A vision-language config (Qwen2.5-VL) is
planned with its vision tower, and its export laid out as save_pretrained writes it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .format.layout import dim0_row_bytes, dim0_rows
from .format.retention_plan import RetentionPolicy, disk_bytes, steps_held
from .log import quieted
from .save.retention import peak_steps, verl_peak_steps

HELP = "predict per-rank checkpoint bytes, host memory and time from a model config (no weights)"

FP32 = 4
ADAM_STATES = 2  # exp_avg, exp_avg_sq
STEP_BYTES = 4  # AdamW's per-parameter step (a 0-dim fp32 tensor)
VERL_CONTENTS = ("model", "optimizer", "extra")


# --------------------------------------------------------------------------- pure arithmetic


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    trainable: bool = True
    itemsize: int = FP32

    @property
    def rows(self) -> int:
        return dim0_rows(self.shape)

    @property
    def row_bytes(self) -> int:
        return dim0_row_bytes(self.shape, self.itemsize)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


def shard_rows(rows: int, world: int, rank: int) -> int:
    """Rows of a dim-0 sharded tensor on `rank` (torch.chunk: ceil(rows/world) per rank, the
    last ranks get fewer or none)."""
    chunk = -(-rows // world)
    return max(0, min(chunk, rows - rank * chunk))


def model_shard_bytes(params: Sequence[ParamSpec], world: int, rank: int) -> int:
    return sum(shard_rows(p.rows, world, rank) * p.row_bytes for p in params)


def optim_shard_bytes(params: Sequence[ParamSpec], world: int, rank: int) -> int:
    return sum(ADAM_STATES * shard_rows(p.rows, world, rank) * p.row_bytes + STEP_BYTES
               for p in params if p.trainable)


def largest_shard_bytes(params: Sequence[ParamSpec], world: int, rank: int) -> int:
    return max((shard_rows(p.rows, world, rank) * p.row_bytes for p in params), default=0)


@dataclass(frozen=True)
class Strategy:
    """One way of saving: verl's, or a recipe's actor checkpoint config."""

    name: str
    contents: tuple[str, ...] = VERL_CONTENTS
    incremental: bool = False
    async_save: bool = False
    async_stream: bool = False  # async_save=stream: no staging pool, the writer reads the live shards
    export_hf: bool = False
    export_dtype: str = "bf16"  # auto: the parameters' dtype (fp32), as verl's hf_model writes
    bucket_mb: int = 64
    write_threads: int = 1
    host_memory_budget_gb: float | str = 16.0  # "auto": resolved per node (resolve_auto_budget)
    max_shard_size: str | None = None  # the export's file size limit (None: save_pretrained's)
    # trainer.max_actor_ckpt_to_keep / max_critic_ckpt_to_keep of the run (None: keep every step)
    actor_keep: int | None = None
    critic_keep: int | None = None
    # retention's keep_optimizer_last and keep_best (slimckpt.format.retention_plan)
    keep_optimizer_last: int | None = None
    keep_best: int = 0

    @property
    def hf_model(self) -> bool:
        return "hf_model" in self.contents

    @classmethod
    def from_checkpoint_config(cls, name: str, cfg: dict[str, Any]) -> "Strategy":
        from dataclasses import MISSING, fields

        from .verl.checkpoint_config import SlimCheckpointConfig, async_mode

        defaults = {f.name: f.default for f in fields(SlimCheckpointConfig) if f.default is not MISSING}
        return cls(
            name=name,
            contents=tuple(cfg.get("save_contents") or VERL_CONTENTS),
            incremental=bool(cfg.get("incremental_save", False)),
            async_save=async_mode(cfg.get("async_save", False)) != "off",
            async_stream=async_mode(cfg.get("async_save", False)) == "stream",
            export_hf=bool(cfg.get("export_hf", False)),
            export_dtype=str(cfg.get("export_dtype", defaults["export_dtype"])),
            bucket_mb=int(cfg.get("bucket_mb", defaults["bucket_mb"])),
            write_threads=int(cfg.get("write_threads", defaults["write_threads"])),
            host_memory_budget_gb=_budget_value(cfg.get("host_memory_budget_gb", defaults["host_memory_budget_gb"])),
            keep_optimizer_last=parse_keep("keep_optimizer_last", cfg.get("keep_optimizer_last")),
            keep_best=parse_keep("keep_best", cfg.get("keep_best")) or 0,
            max_shard_size=str(cfg.get("max_shard_size", defaults.get("max_shard_size"))) if bool(
                cfg.get("export_hf", False)) else None,
        )


def _budget_value(value: Any) -> float | str:
    from .save.host_budget import AUTO, is_auto

    return AUTO if is_auto(value) else float(value)


@dataclass
class Estimate:
    strategy: str
    rank0_write_bytes: int  # the largest rank's resume-state bytes
    total_write_bytes: int  # all ranks, resume state
    hf_export_bytes: int  # the HF export written at each save, in its dtype (0 if none)
    host_peak_bytes: int  # extra host memory of the largest rank during a save
    host_note: str
    blocking: str
    write_seconds: float | None = None
    notes: list[str] = field(default_factory=list)
    # async_save=stream: the next optimizer step's guard for each rollout window (with --disk-gbps)
    stream: list[dict[str, Any]] = field(default_factory=list)
    device_bytes: int = 0  # what the save adds on the accelerator (FSDP1's sharded state dict)
    budget_bytes: int | None = None  # host_memory_budget_gb as resolved for this plan (auto: per node)
    pool_over_budget: bool = False  # async pool mode that saves synchronously
    rank0_only_bytes: int = 0  # of host_peak_bytes, what only rank 0 holds (verl's hf_model gather)


ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "auto": 4}  # auto: fp32 master weights, as verl keeps them


def export_bytes(strategy: Strategy, hf_bytes: int, hf_dtype: str) -> int:
    """The export's size in the dtype this strategy writes: verl's hf_model and export_dtype=auto
    write the parameters' dtype (fp32); `hf_bytes` was laid out in `hf_dtype`."""
    if not (strategy.hf_model or strategy.export_hf):
        return 0
    dtype = "auto" if strategy.hf_model and not strategy.export_hf else strategy.export_dtype
    return hf_bytes * ELEM_BYTES.get(dtype, 2) // ELEM_BYTES.get(hf_dtype, 2)


def estimate(params: Sequence[ParamSpec], world: int, strategy: Strategy, extra_bytes: int,
             hf_bytes: int, disk_gbps: float | None, fsdp: int = 1, hf_dtype: str = "bf16",
             rollout_s: list[float] | None = None, copy_gbps: float | None = None,
             offload: Sequence[str] = (), device: str = "accelerator") -> Estimate:
    """Bytes, host memory and time of one save with `strategy` at world size `world`, training
    with FSDP `fsdp` (1: verl's strategy=fsdp, its default; 2: strategy=fsdp2) on accelerators, or
    with `device="cpu"` on host memory (verl on CPU): there no save copies a tensor to the host, it
    is there already, so only what a path allocates beside the live tensors counts (hf_model's
    gather, a staging pool, the export's cast chunks). `offload`: what verl offloads between
    updates ("param", "optimizer"). host_memory_budget_gb must be a number here
    (resolve_auto_budget)."""
    on_cpu = device == "cpu"
    model_r = model_shard_bytes(params, world, 0) if "model" in strategy.contents else 0
    optim_r = optim_shard_bytes(params, world, 0) if "optimizer" in strategy.contents else 0
    extra_r = extra_bytes if "extra" in strategy.contents else 0
    total = sum((model_shard_bytes(params, world, r) if "model" in strategy.contents else 0)
                + (optim_shard_bytes(params, world, r) if "optimizer" in strategy.contents else 0)
                + extra_r for r in range(world))
    full_fp32 = sum(p.nbytes for p in params)
    export = export_bytes(strategy, hf_bytes, hf_dtype)
    notes: list[str] = []
    largest = largest_shard_bytes(params, world, 0)
    if not strategy.incremental:
        # torch.save copies accelerator storages to host one at a time; FSDP1's sharded model state
        # dict is taken with offload_to_cpu=True, so the whole model shard sits in host RAM first
        if on_cpu:
            peak = largest if strategy.hf_model else 0
            note = "CPU: torch.save pickles the host tensors in place"
            if strategy.hf_model:
                note += " (the gather's largest tensor shard in flight)"
        elif fsdp == 1 and model_r:
            peak = model_r + largest
            note = "FSDP1: the rank's model shard offloaded to host at once, then optimizer tensors one by one"
        else:
            peak = largest
            note = "tensors copied to host one at a time by torch.save"
        if strategy.hf_model:
            peak += full_fp32
            note += " + full fp32 model gathered on rank 0"
        blocking = "whole save"
    else:
        staged = model_r + optim_r
        # DCP copies ahead at most bucket_mb per thread beyond the tensor being written, and never
        # more than the rank holds
        streaming = min(staged, strategy.write_threads * (strategy.bucket_mb * 2**20 + largest))
        if fsdp == 1 and staged:
            notes.append(f"FSDP1: its reshardable sharded state dict is a transient {human(staged)} copy "
                         f"{'in host memory, counted' if on_cpu else 'on the accelerator'} (strategy=fsdp2 has none)")
        offloaded = (model_r if "param" in offload else 0) + (optim_r if "optimizer" in offload else 0)
        if on_cpu and not (strategy.async_save and not strategy.async_stream and staged <= budget_bytes(strategy)):
            # DCP writes host tensors as they are; an export cast to another dtype goes through one
            # bucket_mb chunk per thread
            cast = strategy.export_hf and strategy.export_dtype != "auto"
            peak = strategy.write_threads * strategy.bucket_mb * 2**20 if cast else 0
            note = "CPU: written from the live host tensors" + (", the export cast in bucket_mb chunks" if cast else "")
            peak += staged if fsdp == 1 else 0
            blocking = ("capture only, while the rollout window >= the write (see stream mode below)"
                        if strategy.async_stream else "whole save")
            if strategy.async_save and not strategy.async_stream:
                notes.append(f"over host_memory_budget_gb={strategy.host_memory_budget_gb}: saves synchronously")
        elif strategy.async_stream and offloaded:
            peak = streaming
            note = (f"streamed from the host copies verl's offload makes ({human(offloaded)}: no copy of its own, no "
                    f"device memory past the offload) and the live shards: write_threads x (bucket_mb + largest "
                    f"tensor shard); a reload before the write ends keeps the unread host copies alive, at most "
                    f"{human(offloaded)}" + (f", and the next step's guard copies what is unread of the rest (at most "
                                             f"{human(min(staged - offloaded, strategy.host_memory_budget_gb * 2**30))})"
                                             if staged > offloaded else ""))
            blocking = "capture only, while the rollout window >= the write (see stream mode below)"
        elif strategy.async_stream:
            peak = streaming
            note = ("streamed from the live shards: write_threads x (bucket_mb + largest tensor shard), plus what the "
                    f"next step's guard copies if it comes before the write ends (at most "
                    f"{human(min(staged, float(strategy.host_memory_budget_gb) * 2**30))}, host_memory_budget_gb)")
            blocking = "capture only, while the rollout window >= the write (see stream mode below)"
        elif strategy.async_save and staged <= budget_bytes(strategy):
            peak = staged
            note = "staging pool (pinned), allocated once and held for the run"
            blocking = f"staging copy of {staged / 2**30:.2f} GiB"
        else:
            peak = streaming
            note = "streamed: write_threads x (bucket_mb + largest tensor shard)"
            blocking = "whole save"
            if strategy.async_save:
                notes.append(f"over host_memory_budget_gb={strategy.host_memory_budget_gb}: saves synchronously")
    if strategy.incremental and strategy.export_hf:
        notes.append("HF export written without a gather: every rank its own rows, in place"
                     + ("" if strategy.export_dtype == "auto" else f" (cast to {strategy.export_dtype} in "
                                                                   f"bucket_mb chunks)"))
    elif strategy.export_hf:
        notes.append("HF export streamed from the fresh shards by all ranks (bounded chunks)")
    elif strategy.hf_model:
        notes.append("HF export (fp32) gathered and written by rank 0")
    seconds = None
    if disk_gbps:
        seconds = (total + export) / (disk_gbps * 1e9)
    stream = []
    if strategy.incremental and strategy.async_stream and seconds:
        from dataclasses import asdict as _asdict

        from .stream_model import stream_block, windows_for

        budget = int(budget_bytes(strategy))
        stream = [{**_asdict(b), "window_s": w, "blocked_s": b.blocked_s}
                  for w in windows_for(seconds, rollout_s)
                  for b in [stream_block(model_r + optim_r, seconds, w, budget, copy_gbps,
                                         (model_r if "param" in offload else 0)
                                         + (optim_r if "optimizer" in offload else 0))]]
    budget_b = int(budget_bytes(strategy))
    pool_over = bool(strategy.incremental and strategy.async_save and not strategy.async_stream
                     and model_r + optim_r > budget_b)
    return Estimate(strategy.name, model_r + optim_r + extra_r, total, export, peak, note, blocking, seconds, notes,
                    stream, device_extra_bytes(strategy, fsdp, model_r + optim_r), budget_b, pool_over,
                    full_fp32 if strategy.hf_model and not strategy.incremental else 0)


# --------------------------------------------------------------------------- the node (plan_node) and auto


def device_extra_bytes(strategy: Strategy, fsdp: int, staged: int) -> int:
    """Accelerator memory a save adds beyond training's own: the incremental tier on FSDP1 builds
    its reshardable state dict as new device tensors (chunks cut and cloned from the flat
    parameters and the flat optimizer state), alive while they are written; FSDP2's are views.
    verl's own FSDP1 save offloads each chunk to host as it is made (counted in host memory)."""
    return staged if strategy.incremental and fsdp == 1 else 0


def resolve_auto_budget(strategy: Strategy, node_memory_bytes: int, local_ranks: int, resident: int) -> Strategy:
    """A strategy whose host_memory_budget_gb is `auto`, with the number a rank of this node gets
    (slimckpt.save.host_budget: half of what the node has left once `resident` per rank is held)."""
    from .plan_node import auto_budget
    from .save.host_budget import is_auto

    if not is_auto(strategy.host_memory_budget_gb):
        return strategy
    return replace(strategy, host_memory_budget_gb=auto_budget(node_memory_bytes, local_ranks, resident) / 2**30)


def node_memory_bytes(given_gb: float | None) -> tuple[int, str]:
    """The training node's RAM: given, or this machine's MemTotal (the head node is a training node
    in verl's multi-node set-up)."""
    if given_gb:
        return int(float(given_gb) * 2**30), "given"
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024, "this machine's MemTotal"
    raise ValueError("slimckpt plan: cannot read this machine's memory; pass --node-memory-gb")


def offload_of(args: argparse.Namespace) -> Any:
    """verl's offload switches of the run (plan_node.Offload): `--offload` for the actor (and the
    critic unless the namespace says otherwise, as a dry run's does)."""
    from .plan_node import Offload

    choice = getattr(args, "offload", "none") or "none"
    param = choice in ("param", "both") or bool(getattr(args, "param_offload", False))
    optim = choice in ("optimizer", "both") or bool(getattr(args, "optimizer_offload", False))
    critic_param = bool(getattr(args, "critic_param_offload", param))
    critic_optim = bool(getattr(args, "critic_optimizer_offload", optim))
    return Offload(actor_param=param, actor_optimizer=optim, critic_param=critic_param, critic_optimizer=critic_optim,
                   ref_param=bool(getattr(args, "ref_param_offload", False)), critic=bool(getattr(args, "critic", False)),
                   ref=bool(getattr(args, "ref_param_offload", False)))


def node_context(args: argparse.Namespace, params: Sequence[ParamSpec]) -> dict[str, Any]:
    """Ranks per node, the node's memory and what verl's offload keeps on the host per rank."""
    from .plan_node import resident_bytes

    world = args.world_size
    given_ranks = getattr(args, "gpus_per_node", None)
    ranks = int(given_ranks) if given_ranks else min(world, 8)
    memory, source = node_memory_bytes(getattr(args, "node_memory_gb", None))
    offload = offload_of(args)
    trainable = [p for p in params if p.trainable]
    elements = sum(shard_rows(p.rows, world, 0) * p.row_bytes // p.itemsize for p in trainable)
    critic = critic_params(params) if offload.critic else []
    critic_elements = sum(shard_rows(p.rows, world, 0) * p.row_bytes // p.itemsize for p in critic)
    resident = resident_bytes(model_shard_bytes(params, world, 0), elements, model_shard_bytes(critic, world, 0),
                              critic_elements, offload)
    return {"local_ranks": ranks, "local_ranks_given": bool(given_ranks), "memory_bytes": memory,
            "memory_source": source, "offload": asdict(offload), "resident": resident,
            "resident_bytes": sum(resident.values())}


def node_rows(node: dict[str, Any], estimates: list[dict[str, Any]], copy_gbps: float | None = None
              ) -> list[dict[str, Any]]:
    """Each strategy's node verdict (plan_node.node_verdict): host memory per rank and node, the
    budget, blocked seconds per save, device memory added, and what to change."""
    from .plan_node import node_verdict

    rows = []
    for e in estimates:
        stream = bool(e.get("stream"))
        if stream:  # the longest over the windows planned
            blocked = max((b["blocked_s"] for b in e["stream"] if b["blocked_s"] is not None), default=None)
        elif e["blocking"] == "whole save":
            blocked = e["write_seconds"]
        else:  # pool: the staging copy
            blocked = e["rank0_write_bytes"] / (copy_gbps * 1e9) if copy_gbps else None
        # the critic saves after the actor: its transient memory is not added, but a pool is held for the run
        held_pool = e["host_note"].startswith("staging pool")
        save_host = e["host_peak_bytes"] + (e.get("critic_host_peak_bytes", 0) if held_pool else 0)
        v = node_verdict(e["strategy"], save_host, node["resident_bytes"], node["local_ranks"],
                         node["memory_bytes"], e.get("budget_bytes"), e["rank0_write_bytes"], blocked,
                         e.get("device_bytes", 0), stream, bool(e.get("pool_over_budget")),
                         e.get("rank0_only_bytes", 0))
        rows.append({**asdict(v), "fits": v.fits})
    return rows


def budget_bytes(strategy: Strategy) -> float:
    return float(strategy.host_memory_budget_gb) * 2**30


def human(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def peak_disk(per_step: int, max_keep: int | None) -> dict[str, Any]:
    """Disk one role needs while a step is written, keeping `max_keep` steps (None: all of them)."""
    verl_steps, slim = verl_peak_steps(max_keep), peak_steps(max_keep)
    if verl_steps is None or slim is None:
        return {"max_ckpt_to_keep": max_keep, "per_step_bytes": per_step, "grows_without_bound": True,
                "verl_steps": None, "verl_bytes": None, "slimckpt_steps": None, "slimckpt_bytes": None,
                "slimckpt_steps_tracker_behind": None, "slimckpt_bytes_tracker_behind": None}
    return {"max_ckpt_to_keep": max_keep, "per_step_bytes": per_step, "grows_without_bound": False,
            "verl_steps": verl_steps, "verl_bytes": verl_steps * per_step,
            "slimckpt_steps": slim[0], "slimckpt_bytes": slim[0] * per_step,
            "slimckpt_steps_tracker_behind": slim[1], "slimckpt_bytes_tracker_behind": slim[1] * per_step}


def retention_disk(per_step: int, optimizer_bytes: int, max_keep: int | None, keep_optimizer_last: int | None,
                   keep_best: int = 0) -> dict[str, Any]:
    """Disk one role holds while a step is written under slimckpt's retention with keep_optimizer_last
    and keep_best: whole steps, steps without their optimizer state (`optimizer_bytes` less), and
    the bytes; with max_keep None, how much each save adds."""
    policy = RetentionPolicy(max_keep=max_keep, optimizer_last=keep_optimizer_last, keep_best=keep_best)
    held = steps_held(policy, peak_steps(max_keep))
    out = {"max_ckpt_to_keep": max_keep, "keep_optimizer_last": keep_optimizer_last, "keep_best": keep_best,
           "per_step_bytes": per_step, "optimizer_bytes": optimizer_bytes, "steps": held,
           "bytes": disk_bytes(per_step, optimizer_bytes, held)}
    if held is None:  # every step kept: each save adds one, without its optimizer once it is old enough
        out["bytes_per_save"] = per_step - (optimizer_bytes if keep_optimizer_last is not None else 0)
    return out


def critic_params(params: Sequence[ParamSpec]) -> list[ParamSpec]:
    """verl's critic: the actor's model with a one-output value head (`score`) in place of lm_head
    (without the actor's LoRA adapter, trained in full)."""
    params = [replace(p, trainable=True) for p in params if ".lora_" not in p.name]
    hidden = next((p.shape[-1] for p in params if p.name == "lm_head.weight" or p.name.endswith("embed_tokens.weight")),
                  None)
    body = [p for p in params if p.name != "lm_head.weight"]
    return body + ([ParamSpec("score.weight", (1, hidden))] if hidden else [])


def parse_keep(key: str, value: Any) -> int | None:
    """A max_*_ckpt_to_keep value as verl reads it: a whole number; none/null, 0 or below keep all."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "~", "")):
        return None
    try:
        n = int(str(value).strip())
    except ValueError:
        raise ValueError(f"slimckpt plan: {key}={value!r}: give a whole number of steps, e.g. {key}=2, "
                         f"or none to keep every step") from None
    return n if n > 0 else None


# --------------------------------------------------------------------------- the model, from its config


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
    import shutil
    import tempfile

    src = os.path.join(config_path, "config.json") if os.path.isdir(config_path) else config_path
    if not os.path.isfile(src):
        raise FileNotFoundError(f"slimckpt plan: {src} does not exist; pass a model's config.json (or its dir)")
    tmp = tempfile.TemporaryDirectory(prefix="slimckpt-plan-")
    os.makedirs(os.path.join(tmp.name, "huggingface"))
    shutil.copy(src, os.path.join(tmp.name, "huggingface", "config.json"))
    return tmp.name, tmp


def model_facts(config_path: str, export_dtype: str = "bf16", max_shard_size: str | int | None = None,
                trust_remote_code: bool = False, lora: LoraSpec | None = None) -> ModelFacts:
    from .format import layout
    from .format.names import DTYPE_CHOICES as DTYPE_NAMES
    from .hf.naming import HfSide, default_max_shard_size

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
        return ModelFacts(params=params, total_parameters=total + (lora_facts or {}).get("parameters", 0),
                          tied=tied, hf_files=files, hf_bytes=sum(b for _, b in files), hf_dtype=export_dtype,
                          max_shard_size=size, split_on_save=split, lora=lora_facts, vision_parameters=vision)


def _is_vision(name: str) -> bool:
    """A vision tower's tensor (Qwen2-VL/2.5-VL `visual.`, LLaVA-style `vision_tower.`, projectors)."""
    parts = name.split(".")
    return any(p in ("visual", "vision_tower", "vision_model", "multi_modal_projector") for p in parts)


def _with_lora(model, params: list[ParamSpec], files: list[tuple[str, int]], lora: LoraSpec,
               export_dtype: str) -> tuple[list[ParamSpec], list[tuple[str, int]], dict[str, Any]]:
    """A LoRA actor, wrapped as verl wraps it (peft's get_peft_model with verl's LoraConfig keys, on
    the meta model): the base frozen (no AdamW state), the adapter trainable fp32 (on fused MoE
    experts too, where peft puts it); the export adds lora_adapter/ (what verl's merger and
    slimckpt's exports write), its tensors in export_dtype."""
    import warnings

    from peft import LoraConfig, TaskType, get_peft_model

    from .format import layout
    from .format.names import DTYPE_CHOICES as DTYPE_NAMES

    if lora.rank < 1:
        raise ValueError(f"slimckpt plan: --lora-rank {lora.rank}: give the adapter's rank, 1 or more")
    config = LoraConfig(task_type=TaskType.CAUSAL_LM, r=lora.rank, lora_alpha=lora.alpha,
                        target_modules=lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules),
                        target_parameters=list(lora.target_parameters) or None,
                        exclude_modules=list(lora.exclude_modules) or None, bias="none")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped = get_peft_model(model, config)
    except ValueError as exc:
        raise ValueError(f"slimckpt plan: LoRA ({_lora_keys(lora)}): {str(exc).strip().splitlines()[0]}") from None
    adapter = [ParamSpec(n.removeprefix("base_model.model."), tuple(t.shape))
               for n, t in wrapped.named_parameters() if t.requires_grad]
    specs = [layout.TensorSpec("base_model.model." + p.name.replace(".default.", "."), DTYPE_NAMES[export_dtype],
                               p.shape) for p in adapter]
    adapter_bytes = sum(f.size for f in layout.plan_files(specs, 1 << 62).files)
    modules = {p.name.split(".lora_")[0] for p in adapter}
    facts = {"rank": lora.rank, "alpha": lora.alpha, "modules": len(modules), "keys": _lora_keys(lora),
             "parameters": sum(p.rows * (p.row_bytes // p.itemsize) for p in adapter), "adapter_bytes": adapter_bytes}
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
    import random

    import numpy as np
    import torch

    buf = io.BytesIO()
    torch.save({"rng": {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}},
               buf)
    return buf.tell()


def recipe_strategies(names: Sequence[str] | None, overrides: Sequence[str] = ()) -> list[Strategy]:
    """The actor checkpoint config of each recipe, with `key=value` overrides applied to all."""
    import yaml

    from .verl.recipes import list_group

    options = {o.name: o for o in list_group("recipe")}
    chosen = list(names) if names else sorted(options)
    unknown = [n for n in chosen if n not in options]
    if unknown:
        raise ValueError(f"slimckpt plan: no recipe {unknown[0]!r}; known: {', '.join(sorted(options))}")
    extra = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"slimckpt plan: --set {item!r}: use KEY=VALUE, e.g. --set async_save=true")
        extra[key.strip()] = yaml.safe_load(value)
    suffix = "".join(f" {k}={v}" for k, v in extra.items())
    out = []
    for name in chosen:
        data = yaml.safe_load(options[name].path.read_text()) or {}
        cfg = ((data.get("actor_rollout_ref") or {}).get("actor") or {}).get("checkpoint") or {}
        trainer = data.get("trainer") or {}
        strategy = Strategy.from_checkpoint_config(f"+recipe={name}{suffix}", {**cfg, **extra})
        out.append(replace(strategy, actor_keep=parse_keep("trainer.max_actor_ckpt_to_keep",
                                                           trainer.get("max_actor_ckpt_to_keep")),
                           critic_keep=parse_keep("trainer.max_critic_ckpt_to_keep",
                                                  trainer.get("max_critic_ckpt_to_keep"))))
    return out


# --------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the model's Hugging Face config.json (or its directory)")
    p.add_argument("--world-size", type=int, required=True, help="FSDP ranks of the actor (GPUs)")
    p.add_argument("--recipe", action="append", default=None,
                   help="a slimckpt recipe to compare (repeatable; default: all of them)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe's checkpoint key, e.g. --set async_save=true --set host_memory_budget_gb=32; "
                        "trainer.max_actor_ckpt_to_keep=N and trainer.max_critic_ckpt_to_keep=N set retention")
    p.add_argument("--max-actor-ckpt-to-keep", dest="max_actor_ckpt_to_keep", default=None, metavar="N",
                   help="trainer.max_actor_ckpt_to_keep for every row's peak disk (none: keep every step; "
                        "default: each row's own, a recipe's value or verl's null)")
    p.add_argument("--max-critic-ckpt-to-keep", dest="max_critic_ckpt_to_keep", default=None, metavar="N",
                   help="trainer.max_critic_ckpt_to_keep, the same for the critic (with --critic)")
    p.add_argument("--critic", action="store_true",
                   help="the run has a critic (PPO with GAE): count its checkpoints in the peak disk")
    p.add_argument("--disk-gbps", type=float, default=None,
                   help="aggregate write bandwidth of the checkpoint storage, GB/s (10^9), for the time column")
    p.add_argument("--rollout-s", default=None, metavar="S[,S...]",
                   help="async_save=stream: seconds from a save to the next optimizer step (rollout, reward, "
                        "reference passes), comma separated; default: 0, 1/4, 1/2, 1 and 2 times the write time")
    p.add_argument("--copy-gbps", type=float, default=None,
                   help="async_save=stream: device-to-host copy bandwidth per rank, GB/s, for the guard's copy time "
                        "(without it the copy is shown in bytes)")
    p.add_argument("--offload", choices=["none", "param", "optimizer", "both"], default="none",
                   help="verl's actor fsdp_config.param_offload / optimizer_offload of the run (both: the 70B "
                        "launcher's); async_save=stream then reads the offload's host copies")
    p.add_argument("--fsdp", type=int, choices=[1, 2], default=1,
                   help="FSDP version of the run: 1 = verl's strategy=fsdp (its default), 2 = strategy=fsdp2")
    p.add_argument("--device", choices=["accelerator", "cpu"], default="accelerator",
                   help="where training holds the tensors: accelerator (GPUs, NPUs: a save copies them to host) "
                        "or cpu (verl on CPU, SLIMCKPT_CPU=1: they are host memory already)")
    p.add_argument("--export-dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="HF listing's dtype (default: the export_dtype of the recipes that export, where they agree; "
                        "else bf16)")
    p.add_argument("--max-shard-size", default=None,
                   help="HF export file size limit, e.g. 5GB (default: the exporting recipes' max_shard_size, where "
                        "they agree; else save_pretrained's, as verl uses)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="a LoRA actor (verl's actor_rollout_ref.model.lora_rank): the base model frozen, only the "
                        "adapter trained; its export adds lora_adapter/")
    p.add_argument("--lora-alpha", type=float, default=16, help="verl's model.lora_alpha (reported only)")
    p.add_argument("--lora-target-modules", default="all-linear",
                   help="verl's model.target_modules: all-linear (its default; with transformers 5 peft also adapts "
                        "fused MoE experts and routers) or module names, comma separated")
    p.add_argument("--lora-exclude-modules", default="", help="verl's model.exclude_modules, comma separated")
    p.add_argument("--lora-target-parameters", default="",
                   help="verl's model.target_parameters (LoRA on nn.Parameters, e.g. fused experts), comma separated")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_node_arguments(p)


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    """The node's side: ranks per node, its memory and verl's offload (plan_node)."""
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="ranks per node (trainer.n_gpus_per_node; default: the world size, at most 8)")
    p.add_argument("--node-memory-gb", type=float, default=None,
                   help="host memory of a training node, GiB (default: this machine's); host_memory_budget_gb=auto "
                        "and the per-node check use it")
    p.add_argument("--ref-param-offload", action="store_true",
                   help="the run has a reference model with param_offload (its bf16 params on the host)")


def plan_strategies(args: argparse.Namespace) -> list[Strategy]:
    """verl's two rows and the recipes asked for, with the retention overrides of `args`."""
    keep_given, overrides = retention_overrides(args)  # a bad value fails before the model is built
    strategies = [Strategy("verl default"), Strategy("verl + hf_model", contents=(*VERL_CONTENTS, "hf_model"))]
    strategies += recipe_strategies(args.recipe, overrides)
    return [replace(s, **keep_given) for s in strategies]


def plan_facts(args: argparse.Namespace, strategies: Sequence[Strategy] | None = None) -> ModelFacts:
    """The model's facts for these arguments (a meta model: the slow part of a plan), its HF listing
    in the dtype and file size the planned recipes export."""
    strategies = plan_strategies(args) if strategies is None else strategies
    dtype, shard_size = listing_format(strategies, args.export_dtype, args.max_shard_size)
    return model_facts(args.config, dtype, shard_size, args.trust_remote_code, lora_spec(args))


def build_report(args: argparse.Namespace, facts: ModelFacts | None = None) -> dict[str, Any]:
    """The plan; `facts` from plan_facts(args) when a caller plans one model more than once."""
    if args.world_size < 1:
        raise ValueError("slimckpt plan: --world-size must be >= 1")
    strategies = plan_strategies(args)
    facts = plan_facts(args, strategies) if facts is None else facts
    extra = extra_state_bytes()
    fsdp = int(getattr(args, "fsdp", 1))
    device = str(getattr(args, "device", "accelerator"))
    with_critic = bool(getattr(args, "critic", False))
    node = node_context(args, facts.params)
    strategies = [resolve_auto_budget(s, node["memory_bytes"], node["local_ranks"], node["resident_bytes"])
                  for s in strategies]
    offload = offload_of(args)
    estimates = []
    for s in strategies:
        e = asdict(estimate(facts.params, args.world_size, s, extra, facts.hf_bytes, args.disk_gbps, fsdp,
                            facts.hf_dtype, rollout_windows(args), getattr(args, "copy_gbps", None),
                            offload.actor_kinds, device))
        if facts.split_on_save and s.incremental and s.export_hf:
            e["notes"].append("fused MoE experts split on save: each rank writes its rows of every per-expert tensor")
        e["peak_disk"] = {"actor": peak_disk(e["total_write_bytes"] + e["hf_export_bytes"], s.actor_keep)}
        slim = s.name.startswith("+recipe=")  # verl's own retention has no keep_optimizer_last / keep_best
        optim = optim_total(facts.params, args.world_size, s)
        e["retention_disk"] = {"actor": [retention_disk(e["total_write_bytes"] + e["hf_export_bytes"], optim, s.actor_keep,
                                                        last, s.keep_best) for last in keep_choices(s, optim)]
                               if slim else []}
        if with_critic:  # the critic saves the same contents, never an HF export
            critic = replace(s, contents=tuple(c for c in s.contents if c != "hf_model"), export_hf=False)
            c = estimate(critic_params(facts.params), args.world_size, critic, extra, 0, None, fsdp, device=device)
            e["peak_disk"]["critic"] = peak_disk(c.total_write_bytes, s.critic_keep)
            c_optim = optim_total(critic_params(facts.params), args.world_size, critic)
            e["retention_disk"]["critic"] = [retention_disk(c.total_write_bytes, c_optim, s.critic_keep, last,
                                                            s.keep_best) for last in keep_choices(s, c_optim)] \
                if slim else []
            e["critic_host_peak_bytes"] = c.host_peak_bytes
        estimates.append(e)
    return {
        "config": args.config,
        "world_size": args.world_size,
        "fsdp": fsdp,
        "offload": list(offload.actor_kinds),
        "device": device,
        "parameters": facts.total_parameters,
        "tied": facts.tied,
        "split_on_save": {"fused_tensors": len(facts.split_on_save), "outputs": sum(facts.split_on_save.values())},
        "lora": facts.lora,
        "vision_parameters": facts.vision_parameters,
        "fp32_model_bytes": sum(p.nbytes for p in facts.params),
        "rank0_model_shard_bytes": model_shard_bytes(facts.params, args.world_size, 0),
        "rank0_optimizer_shard_bytes": optim_shard_bytes(facts.params, args.world_size, 0),
        "extra_bytes_per_rank": extra,
        "largest_tensor_shard_bytes": largest_shard_bytes(facts.params, args.world_size, 0),
        "hf_export": {"dtype": facts.hf_dtype, "max_shard_size": facts.max_shard_size,
                      "files": [{"name": n, "bytes": b} for n, b in facts.hf_files], "bytes": facts.hf_bytes},
        "disk_gbps": args.disk_gbps,
        "estimates": estimates,
        "critic": with_critic,
        "node": node,
        "node_rows": node_rows(node, estimates, getattr(args, "copy_gbps", None)),
    }


def optim_total(params: Sequence[ParamSpec], world: int, strategy: Strategy) -> int:
    """AdamW bytes of all ranks, as a step of `strategy` holds them (0 when it saves no optimizer)."""
    if "optimizer" not in strategy.contents:
        return 0
    return sum(optim_shard_bytes(params, world, r) for r in range(world))


def keep_choices(strategy: Strategy, optimizer_bytes: int) -> list[int | None]:
    """The keep_optimizer_last values the retention table compares: the row's own, every kept step
    (null) and the newest one (1); only the row's own when it saves no optimizer state."""
    if not optimizer_bytes:
        return [strategy.keep_optimizer_last]
    return list(dict.fromkeys([strategy.keep_optimizer_last, None, 1]))


def listing_format(strategies: Sequence[Strategy], dtype: str | None,
                   max_shard_size: str | None) -> tuple[str, str | None]:
    """The HF listing's dtype and file size limit: what was asked; else, where the recipes that export
    agree on them, theirs (export_dtype=auto: fp32, as the export writes); else bf16 and save_pretrained's."""
    exporters = {(s.export_dtype, s.max_shard_size) for s in strategies if s.export_hf}
    theirs = next(iter(exporters)) if len(exporters) == 1 else (None, None)
    their_dtype = {"auto": "fp32"}.get(theirs[0], theirs[0])
    return dtype or their_dtype or "bf16", max_shard_size if max_shard_size is not None else theirs[1]


def rollout_windows(args: argparse.Namespace) -> list[float] | None:
    given = getattr(args, "rollout_s", None)
    if not given:
        return None
    try:
        windows = [float(x) for x in str(given).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"slimckpt plan: --rollout-s {given!r}: give seconds, comma separated, e.g. 30,60") from None
    if any(w < 0 for w in windows):
        raise ValueError(f"slimckpt plan: --rollout-s {given!r}: windows are 0 or more seconds")
    return windows


def lora_spec(args: argparse.Namespace) -> LoraSpec | None:
    rank = int(getattr(args, "lora_rank", 0) or 0)
    if not rank:
        return None
    targets = str(getattr(args, "lora_target_modules", "all-linear") or "all-linear")
    def items(attr: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in str(getattr(args, attr, "") or "").split(",") if x.strip())

    return LoraSpec(rank=rank, alpha=float(getattr(args, "lora_alpha", 16)), exclude_modules=items("lora_exclude_modules"),
                    target_parameters=items("lora_target_parameters"),
                    target_modules=targets if targets == "all-linear" else tuple(t.strip() for t in targets.split(",")))


def retention_overrides(args: argparse.Namespace) -> tuple[dict[str, int | None], list[str]]:
    """The retention keys given (options or `--set trainer.max_*_ckpt_to_keep=N`), as Strategy
    fields; and the other --set items, for the recipes."""
    given: dict[str, int | None] = {}
    rest: list[str] = []
    for item in getattr(args, "overrides", ()) or ():
        key, _, value = item.partition("=")
        key = key.strip()
        if not key.startswith("trainer."):
            rest.append(item)
        elif key in ("trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep"):
            given[key] = value
        else:
            raise ValueError(f"slimckpt plan: --set {key}: of trainer's keys only trainer.max_actor_ckpt_to_keep "
                             f"and trainer.max_critic_ckpt_to_keep change the plan; drop it")
    for key, attr in (("trainer.max_actor_ckpt_to_keep", "max_actor_ckpt_to_keep"),
                      ("trainer.max_critic_ckpt_to_keep", "max_critic_ckpt_to_keep")):
        if getattr(args, attr, None) is not None:
            given[key] = getattr(args, attr)
    fields = {"trainer.max_actor_ckpt_to_keep": "actor_keep", "trainer.max_critic_ckpt_to_keep": "critic_keep"}
    return {fields[k]: parse_keep(k, v) for k, v in given.items()}, rest


def print_report(r: dict[str, Any], out=sys.stdout) -> None:
    w = r["world_size"]
    print(f"model: {r['config']}: {r['parameters']:,} parameters, fp32 {human(r['fp32_model_bytes'])}"
          + (f", tied: {', '.join(r['tied'])}" if r["tied"] else ""), file=out)
    split = r.get("split_on_save") or {}
    if split.get("fused_tensors"):
        print(f"fused MoE experts: {split['fused_tensors']} tensors, split into {split['outputs']} per-expert tensors "
              f"in the HF export (as save_pretrained writes them)", file=out)
    if r.get("vision_parameters"):
        print(f"vision tower: {r['vision_parameters']:,} parameters (sharded and exported with the rest)", file=out)
    lora = r.get("lora")
    if lora:
        print(f"LoRA rank {lora['rank']} (alpha {lora['alpha']:g}) on {lora['modules']} modules ({lora['keys']}, as peft "
              f"wraps them): "
              f"{lora['parameters']:,} trainable parameters; the base is frozen (AdamW state only for the adapter); "
              f"the export adds lora_adapter/ ({human(lora['adapter_bytes'])})", file=out)
    print(f"FSDP{r['fsdp']}, world size {w}: rank 0 holds {human(r['rank0_model_shard_bytes'])} of model and "
          f"{human(r['rank0_optimizer_shard_bytes'])} of AdamW state; largest tensor shard "
          f"{human(r['largest_tensor_shard_bytes'])}; extra state ~{human(r['extra_bytes_per_rank'])} per rank",
          file=out)
    bw = r["disk_gbps"]
    head = ["strategy", "rank 0 writes", "all ranks write", "HF export", "host memory / rank",
            f"time @{bw:g} GB/s" if bw else "time", "training blocked for"]
    rows = [[e["strategy"], human(e["rank0_write_bytes"]), human(e["total_write_bytes"]),
             human(e["hf_export_bytes"]) if e["hf_export_bytes"] else "-", human(e["host_peak_bytes"]),
             f"{e['write_seconds']:.1f} s" if e["write_seconds"] is not None else "(--disk-gbps)", e["blocking"]]
            for e in r["estimates"]]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head, ["-" * n for n in widths], *rows]:
        print("  ".join(str(x).ljust(n) for x, n in zip(row, widths)).rstrip(), file=out)
    print("host memory:", file=out)
    for e in r["estimates"]:
        print(f"  {e['strategy']}: {e['host_note']}" + "".join(f"; {n}" for n in e["notes"]), file=out)
    print_stream(r, out)
    print_node(r, out)
    print_peak_disk(r, out)
    print_retention_disk(r, out)
    hf = r["hf_export"]
    files = hf["files"]
    print(f"HF export ({hf['dtype']}, max_shard_size {hf['max_shard_size']}): {len(files)} file(s), "
          f"{human(hf['bytes'])}", file=out)
    shown = files if len(files) <= 6 else files[:3] + [None] + files[-2:]
    for f in shown:
        print("  ..." if f is None else f"  {f['name']}  {human(f['bytes'])}", file=out)
    if len(files) > 1:
        print("  model.safetensors.index.json", file=out)


def print_stream(r: dict[str, Any], out=sys.stdout) -> None:
    """async_save=stream rows: what the next optimizer step's guard does for each rollout window."""
    rows = [e for e in r["estimates"] if e.get("stream")]
    if not rows:
        if any("async_save=stream" in e["strategy"] for e in r["estimates"]) and not r["disk_gbps"]:
            print("stream mode: pass --disk-gbps for the blocked time against the rollout window", file=out)
        return
    print("stream mode (slimckpt.stream_model): training blocks only if the next optimizer step comes before the "
          "write ends;\n  its guard then copies what is unread into host memory (within host_memory_budget_gb) "
          "and waits for the writer for the rest", file=out)
    kept = any(b.get("kept_bytes") for e in rows for b in e["stream"])
    head = ["strategy", "rollout window", "unread at the step", *(["kept (offload's host copies)"] if kept else []),
            "guard copies", "waits for the writer", "blocked"]
    table = []
    for e in rows:
        for b in e["stream"]:
            blocked = f"{b['blocked_s']:.1f} s" if b["blocked_s"] is not None else \
                f"{b['wait_s']:.1f} s + copy of {human(b['copied_bytes'])}"
            table.append([e["strategy"], f"{b['window_s']:.1f} s", human(b["pending_bytes"]),
                          *([human(b.get("kept_bytes", 0))] if kept else []),
                          human(b["copied_bytes"]), f"{b['wait_s']:.1f} s", blocked])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    for row in [head, ["-" * n for n in widths], *table]:
        print("  ".join(str(x).ljust(n) for x, n in zip(row, widths)).rstrip(), file=out)


def print_node(r: dict[str, Any], out=sys.stdout) -> None:
    """Per rank and per node: verl's offload plus the save, against the node and the budget."""
    node, rows = r.get("node"), r.get("node_rows") or []
    if not node or not rows:
        return
    resident = ", ".join(f"{k} {human(v)}" for k, v in node["resident"].items()) or "nothing (no offload)"
    ranks = f"{node['local_ranks']} ranks" + ("" if node["local_ranks_given"] else " (assumed; --gpus-per-node)")
    print(f"per node: {ranks}, {human(node['memory_bytes'])} of host memory ({node['memory_source']}); "
          f"held per rank between steps by verl's offload: {resident}", file=out)
    head = ["strategy", "host / rank", "host / node", "budget / rank", "device added / rank", "blocked / save", "fits"]
    table = []
    for v in rows:
        blocked = "-" if v["blocked_s"] is None else f"{v['blocked_s']:.1f} s"
        table.append([v["strategy"], human(v["per_rank_bytes"]), human(v["per_node_bytes"]),
                      human(v["budget_bytes"]) if v["budget_bytes"] is not None else "-",
                      human(v["device_bytes"]) if v["device_bytes"] else "0", blocked, "yes" if v["fits"] else "NO"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    for row in [head, ["-" * n for n in widths], *table]:
        print("  ".join(str(x).ljust(n) for x, n in zip(row, widths)).rstrip(), file=out)
    for v in rows:
        for problem in v["problems"]:
            print(f"  {v['strategy']}: {problem}", file=out)


def print_peak_disk(r: dict[str, Any], out=sys.stdout) -> None:
    roles = ("actor", "critic") if r.get("critic") else ("actor",)
    print("peak disk while a step is written (per step x steps held; retention keeps the newest "
          "max_*_ckpt_to_keep, slimckpt deletes only after the new step is complete):", file=out)
    head = ["strategy", "role", "keep", "per step", "verl's order", "slimckpt's order", "slimckpt, tracker behind"]
    rows = []
    for e in r["estimates"]:
        for role in roles:
            d = e["peak_disk"][role]
            keep = "all" if d["max_ckpt_to_keep"] is None else str(d["max_ckpt_to_keep"])
            if d["grows_without_bound"]:
                cells = ["grows without bound"] * 3
            else:
                cells = [f"{human(d['verl_bytes'])} ({d['verl_steps']})",
                         f"{human(d['slimckpt_bytes'])} ({d['slimckpt_steps']})",
                         f"{human(d['slimckpt_bytes_tracker_behind'])} ({d['slimckpt_steps_tracker_behind']})"]
            rows.append([e["strategy"], role, keep, human(d["per_step_bytes"]), *cells])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head, ["-" * n for n in widths], *rows]:
        print("  ".join(str(x).ljust(n) for x, n in zip(row, widths)).rstrip(), file=out)
    print("  (n) = steps on disk. verl's rows (no recipe) run verl's order, +recipe rows slimckpt's: one "
          "step more (keep=1: 3 vs 2).\n  keep all = trainer.max_*_ckpt_to_keep null (verl's default): one more step per "
          "save, no bound.\n  tracker behind: the tracker names a step older than the newest keep at a commit (a "
          "failed save with on_save_error=continue, an async commit ahead of its watcher).", file=out)
    if not r.get("critic"):
        print("  critic not counted: pass --critic for a run with one (PPO with GAE).", file=out)


def print_retention_disk(r: dict[str, Any], out=sys.stdout) -> None:
    """The rows of retention_disk: per strategy that saves optimizer state (or sets keep_best), the
    disk at each keep_optimizer_last choice."""
    roles = ("actor", "critic") if r.get("critic") else ("actor",)
    rows = []
    for e in r["estimates"]:
        for role in roles:
            for d in e.get("retention_disk", {}).get(role, []):
                if not d["optimizer_bytes"] and not d["keep_best"]:
                    continue
                last = "all kept" if d["keep_optimizer_last"] is None else f"newest {d['keep_optimizer_last']}"
                keep = "all" if d["max_ckpt_to_keep"] is None else str(d["max_ckpt_to_keep"])
                if d["steps"] is None:
                    held, usual, behind = "every step", f"+{human(d['bytes_per_save'])} per save", "-"
                else:
                    held = f"{d['steps']['whole']} whole + {d['steps']['without_optimizer']}"
                    usual, behind = human(d["bytes"]["usual"]), human(d["bytes"]["tracker_behind"])
                rows.append([e["strategy"], role, keep, str(d["keep_best"]), last,
                             f"{human(d['per_step_bytes'])} / {human(d['per_step_bytes'] - d['optimizer_bytes'])}",
                             held, usual, behind])
    if not rows:
        return
    print("retention with keep_optimizer_last / keep_best (slimckpt's order; --set keep_optimizer_last=N "
          "--set keep_best=K):", file=out)
    head = ["strategy", "role", "keep", "best", "optimizer in", "step whole / without optimizer",
            "steps held (whole + without)", "peak disk", "tracker behind"]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head, ["-" * n for n in widths], *rows]:
        print("  ".join(str(x).ljust(n) for x, n in zip(row, widths)).rstrip(), file=out)
    print("  a step without its optimizer keeps model, extra state and export; the optimizer of the step before the "
          "newest goes\n  before the next step is written (the tracker names it at the newest's commit). keep_best "
          "counts its steps as extra ones (none among the newest).", file=out)


def run(args: argparse.Namespace) -> int:
    try:
        report = build_report(args)
    except (FileNotFoundError, ValueError, OSError) as exc:
        if str(exc).startswith("slimckpt plan:"):
            print(str(exc).splitlines()[0], file=sys.stderr)
            return 2
        print(_cannot_plan(args, exc), file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - any config it cannot plan: one line, never a traceback
        print(_cannot_plan(args, exc), file=sys.stderr)
        return 2
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print_report(report)
    return 0


def _cannot_plan(args: argparse.Namespace, exc: BaseException) -> str:
    """One line for a config this command cannot plan: what failed, first line only."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"slimckpt plan: cannot plan {args.config}: {type(exc).__name__}: {first}".rstrip(": ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slimckpt.plan", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    from slimckpt.log import cli_logging

    with cli_logging():
        sys.exit(main())
