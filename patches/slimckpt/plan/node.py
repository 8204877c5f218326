"""What a save costs a node, beside what it costs a rank: for `slimckpt plan` and the launchers' dry run.

Pure arithmetic (no torch). A node runs `local_ranks` ranks (trainer.n_gpus_per_node). Between
steps each rank already holds on the host what verl's offload moved there (param_offload: the
rank's fp32 model shard; optimizer_offload: its AdamW state; the same for a PPO critic; the
reference model's params with ref param_offload, in bf16). A save adds the plan's host memory per
rank on top. host_memory_budget_gb=auto (slimckpt.save.host_budget) is a share of what the node
has left once the offloaded copies are resident, over its local ranks.

async_save=stream under offload reads the host copies verl's offload makes (save.stream_guards), so
the writer keeps the whole rollout window and the offload adds no copy of its own: the window
arithmetic is cost.estimate's (stream.stream_block with the offloaded bytes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from slimckpt.save.host_budget import AUTO_SHARE, auto_budget_bytes

BF16 = 2
FP32 = 4
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
BLOCK_LIMIT_S = 1.0  # what "does not block training" means on paper


@dataclass(frozen=True)
class Offload:
    """verl's offload switches of the run, per role."""

    actor_param: bool = False
    actor_optimizer: bool = False
    critic_param: bool = False
    critic_optimizer: bool = False
    ref_param: bool = False
    critic: bool = False  # the run has a critic
    ref: bool = False  # the run has a reference model

    @property
    def any_actor(self) -> bool:
        return self.actor_param or self.actor_optimizer

    @property
    def actor_kinds(self) -> tuple[str, ...]:
        """What the actor offloads, as plan.estimate takes it ("param", "optimizer")."""
        return (("param",) if self.actor_param else ()) + (("optimizer",) if self.actor_optimizer else ())


def resident_bytes(
    params_r: int, elements_r: int, critic_params_r: int, critic_elements_r: int, offload: Offload
) -> dict[str, int]:
    """Host bytes one rank holds between steps because of verl's offload, by what holds them.

    params_r: the rank's fp32 model shard bytes (actor); elements_r: its parameter elements (for
    AdamW's two fp32 moments and the bf16 reference). The critic's likewise."""
    out: dict[str, int] = {}
    if offload.actor_param:
        out["actor params (fp32)"] = params_r
    if offload.actor_optimizer:
        out["actor AdamW state"] = ADAM_BYTES * elements_r
    if offload.critic and offload.critic_param:
        out["critic params (fp32)"] = critic_params_r
    if offload.critic and offload.critic_optimizer:
        out["critic AdamW state"] = ADAM_BYTES * critic_elements_r
    if offload.ref and offload.ref_param:
        out["ref params (bf16)"] = BF16 * elements_r
    return out


def auto_budget(node_memory_bytes: int, local_ranks: int, resident_per_rank: int) -> int:
    """host_memory_budget_gb=auto on a node of `node_memory_bytes` whose ranks each hold
    `resident_per_rank` already (what the first save sees as used)."""
    return auto_budget_bytes(node_memory_bytes - local_ranks * resident_per_rank, local_ranks)


@dataclass
class NodeVerdict:
    """One strategy on one node: its host memory, the budget, blocked time and what to change."""

    strategy: str
    per_rank_bytes: int  # resident offload + the save's host memory
    per_node_bytes: int
    node_memory_bytes: int
    budget_bytes: int | None
    blocked_s: float | None
    device_bytes: int  # what the save adds on the accelerator
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems


def node_verdict(
    strategy: str,
    save_host_bytes: int,
    resident: int,
    local_ranks: int,
    node_memory_bytes: int,
    budget_bytes: int | None,
    staged_bytes: int,
    blocked_s: float | None,
    device_bytes: int,
    stream: bool,
    pool_over_budget: bool,
    rank0_only_bytes: int = 0,
) -> NodeVerdict:
    """Whether the node holds the run's host memory with this save, and the budget holds the save.
    `save_host_bytes` is the largest rank's; `rank0_only_bytes` of it only rank 0 holds."""
    per_rank = resident + save_host_bytes
    verdict = NodeVerdict(
        strategy,
        per_rank,
        per_rank * local_ranks - rank0_only_bytes * (local_ranks - 1),
        node_memory_bytes,
        budget_bytes,
        blocked_s,
        device_bytes,
    )
    if verdict.per_node_bytes > node_memory_bytes:
        verdict.problems.append(
            f"{local_ranks} ranks x {_gib(per_rank)} = {_gib(verdict.per_node_bytes)} is over the node's "
            f"{_gib(node_memory_bytes)}: turn an offload off or save model-only (+recipe=quickstart)"
        )
    if pool_over_budget:
        verdict.problems.append(
            f"the rank's {_gib(staged_bytes)} does not fit host_memory_budget_gb ({_gib(budget_bytes or 0)}): "
            f"every save runs synchronously; use async_save=stream or raise the budget"
        )
    if stream and blocked_s is not None and blocked_s >= BLOCK_LIMIT_S:
        verdict.problems.append(
            f"async_save=stream blocks {blocked_s:.1f} s per save (>= {BLOCK_LIMIT_S:g} s): the write outlasts "
            f"the rollout window and the guard copies or waits; a faster disk or more write_threads shortens it"
        )
    if device_bytes:
        verdict.problems.append(
            f"the save adds {_gib(device_bytes)} on each accelerator (FSDP1's sharded state dict): "
            f"use strategy=fsdp2 (actor_rollout_ref.actor.strategy=fsdp2 critic.strategy=fsdp2)"
        )
    return verdict


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def node_rows(
    node: dict[str, Any], estimates: list[dict[str, Any]], copy_gbps: float | None = None
) -> list[dict[str, Any]]:
    """Each strategy's node verdict (node_verdict): host memory per rank and node, the
    budget, blocked seconds per save, device memory added, and what to change."""
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
        v = node_verdict(
            e["strategy"],
            save_host,
            node["resident_bytes"],
            node["local_ranks"],
            node["memory_bytes"],
            e.get("budget_bytes"),
            e["rank0_write_bytes"],
            blocked,
            e.get("device_bytes", 0),
            stream,
            bool(e.get("pool_over_budget")),
            e.get("rank0_only_bytes", 0),
        )
        rows.append({**asdict(v), "fits": v.fits})
    return rows


__all__ = [
    "AUTO_SHARE",
    "BLOCK_LIMIT_S",
    "NodeVerdict",
    "Offload",
    "auto_budget",
    "node_rows",
    "node_verdict",
    "resident_bytes",
]
