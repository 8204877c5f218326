"""FlowRLLossConfig: verl's PolicyLossConfig plus FlowRL's hyper-parameters.

overrides/algo/flowrl.yaml points `actor_rollout_ref.actor.policy_loss._target_` here. verl builds
this dataclass wherever it builds the actor's config: in the driver (validate_config, and
`slimckpt dryrun`) and in every actor worker before the model is built. Building it is
what switches FlowRL on in that process: the "flowrl" feature of slimckpt.verl.patch_list (the
policy loss "flowrl" in verl's registry, and the engine patches). Without +algo=flowrl it is never built and
verl runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.workers.config import PolicyLossConfig

from slimckpt.verl.features import switch_on
from slimckpt.verl_files.version import check_verl_version
from slimckpt_flowrl.loss import DEFAULT_BETA, DEFAULT_MAX_WEIGHT, LOSS_MODE


@dataclass(frozen=True)
class HeadSettings:
    inner_size: int
    seed: int


_ACTIVE: HeadSettings | None = None


def active_head_settings() -> HeadSettings | None:
    """The log Z head this process's actor gets, or None when FlowRL is not configured here."""
    return _ACTIVE


@dataclass
class FlowRLLossConfig(PolicyLossConfig):
    """Fields beyond verl's PolicyLossConfig:

    beta: reward scale in FlowRL's residual (the paper's beta = 15).
    max_importance_weight: cap of the sequence-level ratio pi_theta(y|x) / pi_old(y|x) (10).
    log_z_hidden_size: width of Z_phi's hidden layer (Linear(hidden, this), GELU, Linear(this, 1)).
    log_z_init_seed: seed of Z_phi's initial weights (identical on every rank and run).
    """

    loss_mode: str = LOSS_MODE
    beta: float = DEFAULT_BETA
    max_importance_weight: float = DEFAULT_MAX_WEIGHT
    log_z_hidden_size: int = 256
    log_z_init_seed: int = 0

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        if self.loss_mode != LOSS_MODE:
            raise ValueError(
                f"policy_loss.loss_mode={self.loss_mode!r} with slimckpt_flowrl.config.FlowRLLossConfig: this config "
                f"is for loss_mode={LOSS_MODE}; drop +algo=flowrl (or the _target_) to use another loss"
            )
        if not self.beta > 0 or not self.max_importance_weight > 0:
            raise ValueError(
                f"policy_loss.beta={self.beta}, max_importance_weight={self.max_importance_weight}: both must be > 0"
            )
        if self.log_z_hidden_size < 1:
            raise ValueError(f"policy_loss.log_z_hidden_size={self.log_z_hidden_size}: must be >= 1")
        activate(HeadSettings(int(self.log_z_hidden_size), int(self.log_z_init_seed)))


def activate(settings: HeadSettings) -> None:
    """Remember the head this process's actor gets, then switch the "flowrl" feature on (the policy
    loss joins verl's registry and the engine patches apply; idempotent)."""
    global _ACTIVE

    check_verl_version()
    _ACTIVE = settings
    switch_on("flowrl")
