"""The arithmetic of a plan: what one save costs a rank, and the disk retention holds (pure functions,
unit-tested).

FSDP shards every parameter along dim 0 in chunks of ceil(rows / W) rows (torch.chunk, as FSDP2
does), so rank 0 holds the most. verl keeps fp32 master weights; AdamW keeps exp_avg and exp_avg_sq
(fp32, the parameter's shape) and a 4-byte step per parameter. Host memory models each path on
accelerators: verl's save hands device tensors to torch.save, which copies them to host one storage
at a time, except that with FSDP1 (verl's default strategy) the model's sharded state dict is taken
with offload_to_cpu=True, so the rank's whole model shard is in host RAM at once; its hf_model save
gathers the whole fp32 model on rank 0. The incremental tier streams (write_threads x (bucket_mb +
the largest tensor shard)) or, async, stages the rank's shards once within host_memory_budget_gb;
with FSDP1 its reshardable state dict costs a transient copy of the rank's shards on the
accelerator. File-format overhead (headers, pickles) is not counted.

The peak disk of the run: a role's bytes per step times the steps it holds while a new one is
written, under verl's retention order and slimckpt's (slimckpt.save.retention.prune.peak_steps: one step
more, since it deletes only once the new step is complete), at trainer.max_actor_ckpt_to_keep /
max_critic_ckpt_to_keep (as given; else each row's own: a recipe's value, verl's null = keep all).
With a recipe's keep_optimizer_last / keep_best the steps held split into whole ones and ones
without their optimizer state (slimckpt.layout.retention_plan.steps_held). The critic (PPO with
GAE) is the actor's shapes with a one-output value head instead of lm_head, saving the same
contents and no Hugging Face export.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from slimckpt.layout.retention_plan import RetentionPolicy, disk_bytes, steps_held
from slimckpt.layout.safetensors_layout import dim0_row_bytes, dim0_rows
from slimckpt.options.checkpoint_options import OPTION_NAMES, CheckpointOptions
from slimckpt.plan.node import auto_budget
from slimckpt.plan.stream import stream_block, windows_for
from slimckpt.save.host_budget import AUTO, is_auto
from slimckpt.save.retention.prune import peak_steps, verl_peak_steps

FP32 = 4
ADAM_STATES = 2  # exp_avg, exp_avg_sq
STEP_BYTES = 4  # AdamW's per-parameter step (a 0-dim fp32 tensor)
VERL_CONTENTS = ("model", "optimizer", "extra")
# how the arithmetic below models each async_save mode (save.async_modes.registry.MODES names them;
# tests/save/test_modes.py holds the two sets of names equal): a background write, and one
# that reads the live shards instead of a staged copy
ASYNC_STRATEGY: dict[str, dict[str, bool]] = {
    "off": {"async_save": False, "async_stream": False},
    "pool": {"async_save": True, "async_stream": False},
    "stream": {"async_save": True, "async_stream": True},
}


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
    return sum(ADAM_STATES * shard_rows(p.rows, world, rank) * p.row_bytes + STEP_BYTES for p in params if p.trainable)


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
    # retention's keep_optimizer_last and keep_best (slimckpt.layout.retention_plan)
    keep_optimizer_last: int | None = None
    keep_best: int = 0

    @property
    def hf_model(self) -> bool:
        return "hf_model" in self.contents

    @classmethod
    def from_checkpoint_config(cls, name: str, cfg: dict[str, Any]) -> Strategy:
        """The row of a recipe's `checkpoint:` config, its settings read as training reads them
        (`checkpoint_options`)."""
        opts = checkpoint_options(name, cfg)
        return cls(
            name=name,
            contents=tuple(cfg.get("save_contents") or VERL_CONTENTS),
            incremental=opts.incremental_save,
            **ASYNC_STRATEGY[opts.async_save],
            export_hf=opts.export_hf,
            export_dtype=opts.export_dtype,
            bucket_mb=opts.bucket_mb,
            write_threads=opts.write_threads,
            host_memory_budget_gb=_budget_value(opts.host_memory_budget_gb),
            keep_optimizer_last=opts.keep_optimizer_last,
            keep_best=opts.keep_best,
            max_shard_size=str(opts.max_shard_size) if opts.export_hf else None,
        )


def checkpoint_options(name: str, cfg: dict[str, Any]) -> CheckpointOptions:
    """A recipe's `checkpoint:` settings as training takes them: `CheckpointOptions` built from its
    keys, so the same spellings are taken and the same values refused, in training's words
    (keep_optimizer_last=0 is refused, not planned as "keep every step's"; keep_best needs its
    best_metric here as in training)."""
    given = {k: v for k, v in cfg.items() if k in OPTION_NAMES}
    try:
        return CheckpointOptions(**given)
    except ValueError as exc:
        raise ValueError(f"slimckpt plan: {name}: {exc}") from None


def _budget_value(value: Any) -> float | str:
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
    export_by_rank0: bool = False  # verl's hf_model: rank 0 alone writes the export, after the shards


ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "auto": 4}  # auto: fp32 master weights, as verl keeps them


def export_bytes(strategy: Strategy, hf_bytes: int, hf_dtype: str) -> int:
    """The export's size in the dtype this strategy writes: verl's hf_model and export_dtype=auto
    write the parameters' dtype (fp32); `hf_bytes` was laid out in `hf_dtype`."""
    if not (strategy.hf_model or strategy.export_hf):
        return 0
    dtype = "auto" if strategy.hf_model and not strategy.export_hf else strategy.export_dtype
    return hf_bytes * ELEM_BYTES.get(dtype, 2) // ELEM_BYTES.get(hf_dtype, 2)


def estimate(
    params: Sequence[ParamSpec],
    world: int,
    strategy: Strategy,
    extra_bytes: int,
    hf_bytes: int,
    disk_gbps: float | None,
    fsdp: int = 1,
    hf_dtype: str = "bf16",
    rollout_s: list[float] | None = None,
    copy_gbps: float | None = None,
    offload: Sequence[str] = (),
    device: str = "accelerator",
    writer_gbps: float | None = None,
) -> Estimate:
    """Bytes, host memory and time of one save with `strategy` at world size `world`, training
    with FSDP `fsdp` (1: verl's strategy=fsdp, its default; 2: strategy=fsdp2) on accelerators, or
    with `device="cpu"` on host memory (verl on CPU): there no save copies a tensor to the host, it
    is there already, so only what a path allocates beside the live tensors counts (hf_model's
    gather, a staging pool, the export's cast chunks). `offload`: what verl offloads between
    updates ("param", "optimizer"). `writer_gbps`: what one process writing alone gets (verl's
    hf_model export is written by rank 0 only, after the shards); `disk_gbps` when not given.
    host_memory_budget_gb must be a number here (resolve_auto_budget)."""
    on_cpu = device == "cpu"
    model_r = model_shard_bytes(params, world, 0) if "model" in strategy.contents else 0
    optim_r = optim_shard_bytes(params, world, 0) if "optimizer" in strategy.contents else 0
    extra_r = extra_bytes if "extra" in strategy.contents else 0
    total = sum(
        (model_shard_bytes(params, world, r) if "model" in strategy.contents else 0)
        + (optim_shard_bytes(params, world, r) if "optimizer" in strategy.contents else 0)
        + extra_r
        for r in range(world)
    )
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
            notes.append(
                f"FSDP1: its reshardable sharded state dict is a transient {human(staged)} copy "
                f"{'in host memory, counted' if on_cpu else 'on the accelerator'} (strategy=fsdp2 has none)"
            )
        offloaded = (model_r if "param" in offload else 0) + (optim_r if "optimizer" in offload else 0)
        if on_cpu and not (strategy.async_save and not strategy.async_stream and staged <= budget_bytes(strategy)):
            # DCP writes host tensors as they are; an export cast to another dtype goes through one
            # bucket_mb chunk per thread
            cast = strategy.export_hf and strategy.export_dtype != "auto"
            peak = strategy.write_threads * strategy.bucket_mb * 2**20 if cast else 0
            note = "CPU: written from the live host tensors" + (", the export cast in bucket_mb chunks" if cast else "")
            peak += staged if fsdp == 1 else 0
            blocking = (
                "capture only, while the rollout window >= the write (see stream mode below)"
                if strategy.async_stream
                else "whole save"
            )
            if strategy.async_save and not strategy.async_stream:
                notes.append(f"over host_memory_budget_gb={strategy.host_memory_budget_gb}: saves synchronously")
        elif strategy.async_stream and offloaded:
            peak = streaming
            note = (
                f"streamed from the host copies verl's offload makes ({human(offloaded)}: no copy of its own, no "
                f"device memory past the offload) and the live shards: write_threads x (bucket_mb + largest "
                f"tensor shard); a reload before the write ends keeps the unread host copies alive, at most "
                f"{human(offloaded)}"
                + (
                    f", and the next step's guard copies what is unread of the rest (at most "
                    f"{human(min(staged - offloaded, strategy.host_memory_budget_gb * 2**30))})"
                    if staged > offloaded
                    else ""
                )
            )
            blocking = "capture only, while the rollout window >= the write (see stream mode below)"
        elif strategy.async_stream:
            peak = streaming
            note = (
                "streamed from the live shards: write_threads x (bucket_mb + largest tensor shard), plus what the "
                f"next step's guard copies if it comes before the write ends (at most "
                f"{human(min(staged, float(strategy.host_memory_budget_gb) * 2**30))}, host_memory_budget_gb)"
            )
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
        notes.append(
            "HF export written without a gather: every rank its own rows, in place"
            + ("" if strategy.export_dtype == "auto" else f" (cast to {strategy.export_dtype} in bucket_mb chunks)")
        )
    elif strategy.export_hf:
        notes.append("HF export streamed from the fresh shards by all ranks (bounded chunks)")
    elif strategy.hf_model:
        notes.append("HF export (fp32) gathered and written by rank 0")
    # verl's hf_model export comes after the shards and only rank 0 writes it; every other export
    # is written by all ranks at once, each its own part
    by_rank0 = strategy.hf_model and not strategy.incremental
    seconds = None
    if disk_gbps:
        export_gbps = (writer_gbps or disk_gbps) if by_rank0 else disk_gbps
        seconds = total / (disk_gbps * 1e9) + export / (export_gbps * 1e9)
    stream = []
    if strategy.incremental and strategy.async_stream and seconds:
        budget = int(budget_bytes(strategy))
        stream = [
            {**asdict(b), "window_s": w, "blocked_s": b.blocked_s}
            for w in windows_for(seconds, rollout_s)
            for b in [
                stream_block(
                    model_r + optim_r,
                    seconds,
                    w,
                    budget,
                    copy_gbps,
                    (model_r if "param" in offload else 0) + (optim_r if "optimizer" in offload else 0),
                )
            ]
        ]
    budget_b = int(budget_bytes(strategy))
    pool_over = bool(
        strategy.incremental and strategy.async_save and not strategy.async_stream and model_r + optim_r > budget_b
    )
    return Estimate(
        strategy.name,
        model_r + optim_r + extra_r,
        total,
        export,
        peak,
        note,
        blocking,
        seconds,
        notes,
        stream,
        device_extra_bytes(strategy, fsdp, model_r + optim_r),
        budget_b,
        pool_over,
        full_fp32 if by_rank0 else 0,
        by_rank0,
    )


def device_extra_bytes(strategy: Strategy, fsdp: int, staged: int) -> int:
    """Accelerator memory a save adds beyond training's own: the incremental tier on FSDP1 builds
    its reshardable state dict as new device tensors (chunks cut and cloned from the flat
    parameters and the flat optimizer state), alive while they are written; FSDP2's are views.
    verl's own FSDP1 save offloads each chunk to host as it is made (counted in host memory)."""
    return staged if strategy.incremental and fsdp == 1 else 0


def resolve_auto_budget(strategy: Strategy, node_memory_bytes: int, local_ranks: int, resident: int) -> Strategy:
    """A strategy whose host_memory_budget_gb is `auto`, with the number a rank of this node gets
    (slimckpt.save.host_budget: half of what the node has left once `resident` per rank is held)."""
    if not is_auto(strategy.host_memory_budget_gb):
        return strategy
    return replace(strategy, host_memory_budget_gb=auto_budget(node_memory_bytes, local_ranks, resident) / 2**30)


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
        return {
            "max_ckpt_to_keep": max_keep,
            "per_step_bytes": per_step,
            "grows_without_bound": True,
            "verl_steps": None,
            "verl_bytes": None,
            "slimckpt_steps": None,
            "slimckpt_bytes": None,
            "slimckpt_steps_tracker_behind": None,
            "slimckpt_bytes_tracker_behind": None,
        }
    return {
        "max_ckpt_to_keep": max_keep,
        "per_step_bytes": per_step,
        "grows_without_bound": False,
        "verl_steps": verl_steps,
        "verl_bytes": verl_steps * per_step,
        "slimckpt_steps": slim[0],
        "slimckpt_bytes": slim[0] * per_step,
        "slimckpt_steps_tracker_behind": slim[1],
        "slimckpt_bytes_tracker_behind": slim[1] * per_step,
    }


def retention_disk(
    per_step: int, optimizer_bytes: int, max_keep: int | None, keep_optimizer_last: int | None, keep_best: int = 0
) -> dict[str, Any]:
    """Disk one role holds while a step is written under slimckpt's retention with keep_optimizer_last
    and keep_best: whole steps, steps without their optimizer state (`optimizer_bytes` less), and
    the bytes; with max_keep None, how much each save adds."""
    policy = RetentionPolicy(max_keep=max_keep, optimizer_last=keep_optimizer_last, keep_best=keep_best)
    held = steps_held(policy, peak_steps(max_keep))
    out = {
        "max_ckpt_to_keep": max_keep,
        "keep_optimizer_last": keep_optimizer_last,
        "keep_best": keep_best,
        "per_step_bytes": per_step,
        "optimizer_bytes": optimizer_bytes,
        "steps": held,
        "bytes": disk_bytes(per_step, optimizer_bytes, held),
    }
    if held is None:  # every step kept: each save adds one, without its optimizer once it is old enough
        out["bytes_per_save"] = per_step - (optimizer_bytes if keep_optimizer_last is not None else 0)
    return out


def critic_params(params: Sequence[ParamSpec]) -> list[ParamSpec]:
    """verl's critic: the actor's model with a one-output value head (`score`) in place of lm_head
    (without the actor's LoRA adapter, trained in full)."""
    params = [replace(p, trainable=True) for p in params if ".lora_" not in p.name]
    hidden = next(
        (p.shape[-1] for p in params if p.name == "lm_head.weight" or p.name.endswith("embed_tokens.weight")), None
    )
    body = [p for p in params if p.name != "lm_head.weight"]
    return body + ([ParamSpec("score.weight", (1, hidden))] if hidden else [])


def parse_keep(key: str, value: Any) -> int | None:
    """A max_*_ckpt_to_keep value as verl reads it: a whole number; none/null, 0 or below keep all."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "~", "")):
        return None
    try:
        n = int(str(value).strip())
    except ValueError:
        raise ValueError(
            f"slimckpt plan: {key}={value!r}: give a whole number of steps, e.g. {key}=2, or none to keep every step"
        ) from None
    return n if n > 0 else None


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


def listing_format(
    strategies: Sequence[Strategy], dtype: str | None, max_shard_size: str | None
) -> tuple[str, str | None]:
    """The HF listing's dtype and file size limit: what was asked; else, where the recipes that export
    agree on them, theirs (export_dtype=auto: fp32, as the export writes); else bf16 and save_pretrained's."""
    exporters = {(s.export_dtype, s.max_shard_size) for s in strategies if s.export_hf}
    theirs = next(iter(exporters)) if len(exporters) == 1 else (None, None)
    their_dtype = {"auto": "fp32"}.get(theirs[0], theirs[0])
    return dtype or their_dtype or "bf16", max_shard_size if max_shard_size is not None else theirs[1]
