"""FlowRL's objective and verl's policy loss "flowrl".

Per sample (prompt x, response y of |y| tokens):

    loss = w * (log Z_phi(x) + (1/|y|) log pi_theta(y|x) - beta * r_hat(x, y) - (1/|y|) log pi_ref(y|x))^2

r_hat is the group-normalised reward (GRPO's advantage, constant over the response), and
w = min(pi_theta(y|x) / pi_old(y|x), max_weight) is the sequence-level importance weight,
detached. Gradients reach pi_theta through the mean log-prob and Z_phi through log Z.

verl 0.9.1's policy-loss signature (old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights) has no log Z and no reference log-probs. verl's
`ppo_loss` (the actor's loss function) has both: its model output and its micro-batch. So the
"flowrl" patch of `ppo_loss` puts them into `flowrl_inputs(...)` for the duration of the call,
and the registered loss below reads them there. Everything else (batch normalisation across
micro-batches and data-parallel ranks, metric plumbing) stays verl's.
"""

# lazy imports: verl's core_algos only when the loss runs (the feature registers it while verl's trainer imports)
from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

LOSS_MODE = "flowrl"
DEFAULT_BETA = 15.0
DEFAULT_MAX_WEIGHT = 10.0


@dataclass(frozen=True)
class FlowRLInputs:
    """What the policy-loss signature lacks, for one micro-batch: log Z per sample (bsz,) and the
    reference model's token log-probs, padded like log_prob (bsz, response_len)."""

    log_z: torch.Tensor
    ref_log_prob: torch.Tensor


_INPUTS: contextvars.ContextVar[FlowRLInputs | None] = contextvars.ContextVar("slimckpt_flowrl_inputs", default=None)


@contextlib.contextmanager
def flowrl_inputs(log_z: torch.Tensor, ref_log_prob: torch.Tensor) -> Iterator[None]:
    token = _INPUTS.set(FlowRLInputs(log_z, ref_log_prob))
    try:
        yield
    finally:
        _INPUTS.reset(token)


def current_inputs() -> FlowRLInputs:
    inputs = _INPUTS.get()
    if inputs is None:
        raise RuntimeError(
            "policy_loss.loss_mode=flowrl needs log Z and the reference log-probs, which only slimckpt's "
            "'flowrl' patch of verl's ppo_loss provides: select FlowRL with +algo=flowrl (its "
            "policy_loss._target_ is slimckpt_flowrl.config.FlowRLLossConfig), not loss_mode=flowrl alone"
        )
    return inputs


def _masked_mean_per_seq(values: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum(dim=-1) / lengths


def flowrl_objective(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    log_z: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float = DEFAULT_BETA,
    max_weight: float = DEFAULT_MAX_WEIGHT,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample FlowRL loss (bsz,) and its parts (each (bsz,), detached).

    Token tensors are (bsz, response_len) with `response_mask` marking the response tokens; a
    sample without response tokens gets loss 0.
    """
    mask = response_mask.to(log_prob.dtype)
    tokens = mask.sum(dim=-1)
    has_tokens = tokens > 0
    lengths = tokens.clamp(min=1)
    mean_log_prob = _masked_mean_per_seq(log_prob, mask, lengths)
    mean_ref_log_prob = _masked_mean_per_seq(ref_log_prob.to(log_prob.dtype), mask, lengths)
    reward = _masked_mean_per_seq(advantages.to(log_prob.dtype), mask, lengths)
    with torch.no_grad():
        seq_log_ratio = ((log_prob - old_log_prob) * mask).sum(dim=-1)
        # clamp in log space: exp of a large log-ratio would overflow before the clamp
        weight = torch.exp(seq_log_ratio.clamp(max=math.log(max_weight)))
    residual = log_z.to(log_prob.dtype) + mean_log_prob - beta * reward - mean_ref_log_prob
    loss = torch.where(has_tokens, weight * residual.pow(2), torch.zeros_like(residual))
    parts = {
        "residual": residual.detach(),
        "weight": weight,
        "weight_clipped": (seq_log_ratio > math.log(max_weight)).to(log_prob.dtype),
        "log_z": log_z.detach().to(log_prob.dtype),
        "reward": reward.detach(),
    }
    return loss, parts


def compute_policy_loss_flowrl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl policy loss "flowrl": the per-sample objective, aggregated by verl's `agg_loss`.

    Each sample's loss is spread over its response tokens, so "seq-mean-token-mean" (the
    +algo=flowrl default) gives the mean over samples of the global mini-batch, normalised the
    way verl normalises every other loss across micro-batches and ranks.
    """
    from verl.trainer.ppo.core_algos import agg_loss

    if rollout_is_weights is not None:
        raise NotImplementedError(
            "loss_mode=flowrl carries its own importance weight; turn rollout correction off "
            "(algorithm.rollout_correction.rollout_is=null)"
        )
    inputs = current_inputs()
    policy_loss = getattr(config, "policy_loss", None)
    beta = float(getattr(policy_loss, "beta", DEFAULT_BETA))
    max_weight = float(getattr(policy_loss, "max_importance_weight", DEFAULT_MAX_WEIGHT))
    per_sample, parts = flowrl_objective(
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        ref_log_prob=inputs.ref_log_prob,
        log_z=inputs.log_z,
        advantages=advantages,
        response_mask=response_mask,
        beta=beta,
        max_weight=max_weight,
    )
    loss_mat = per_sample.unsqueeze(-1).expand_as(log_prob)
    batch_info = dict(getattr(config, "global_batch_info", None) or {})
    loss = agg_loss(loss_mat=loss_mat, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **batch_info)
    # r_hat averages to ~0 within each group by construction: report its spread instead
    metrics = {f"actor/flowrl_{k}": v.mean().item() for k, v in parts.items() if k != "reward"}
    metrics["actor/flowrl_reward_abs"] = parts["reward"].abs().mean().item()
    metrics["actor/flowrl_residual_abs"] = parts["residual"].abs().mean().item()
    return loss, metrics


def registered_loss(_registry: dict) -> Any:
    """The entry "flowrl" of verl's policy-loss registry (the "flowrl.loss.registry" patch)."""
    return compute_policy_loss_flowrl
