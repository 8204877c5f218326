"""What retention does to each saved step of one role: keep it whole, keep it without its optimizer
state, or delete it. Pure: no torch, no file is touched (the caller gives the tracker's step and the
logged metrics); slimckpt.save.retention.prune carries the decision out.

A step's optimizer state (fp32 Adam moments: two thirds of a full step, about 560 GiB of a 70B
model's 1 TiB) is only needed to resume from that step exactly, and a run resumes from its newest
step. So the policy separates the two uses of an old step:

  - `max_keep` (verl's trainer.max_*_ckpt_to_keep): the newest N steps stay; None keeps all.
  - `keep_best` by `best_metric` (`best_mode` max or min): the K steps with the best value of a
    logged metric stay too, whatever their age (verl #3792); a step with no value logged for it is
    never "best".
  - `optimizer_last`: of the steps that stay, only the newest M keep their optimizer state; the
    older ones keep model, extra state (lr schedule, RNG) and the HF export. None: every kept step
    keeps it (verl's behaviour).
  - the step the tracker names is kept whole whatever the rest says: it is the one a restart
    resumes from now.

Steps are given oldest first (verl's `previous_saved_paths` order); ties in the metric go to the
newer step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from slimckpt.storage import absolute

BEST_MODES = ("max", "min")


@dataclass(frozen=True)
class RetentionPolicy:
    max_keep: int | None = None
    optimizer_last: int | None = None
    keep_best: int = 0
    best_metric: str | None = None
    best_mode: str = "max"

    @property
    def prunes_optimizer(self) -> bool:
        return self.optimizer_last is not None


@dataclass
class RetentionDecision:
    keep: list[str] = field(default_factory=list)  # stays tracked, oldest first (whole or without optimizer)
    drop_optimizer: list[str] = field(default_factory=list)  # of `keep`: lose their optimizer state now
    delete: list[str] = field(default_factory=list)
    best: list[str] = field(default_factory=list)  # kept only because they are among the best by the metric
    protected: list[str] = field(default_factory=list)  # kept only because the tracker names them


def _finite(value) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def best_paths(paths: Sequence[str], metrics: Mapping[str, float | None], keep_best: int, mode: str) -> list[str]:
    """The `keep_best` paths with the best finite metric value (ties: the newer one)."""
    if keep_best <= 0:
        return []
    ranked = [(v, i, p) for i, p in enumerate(paths) if (v := _finite(metrics.get(p))) is not None]
    ranked.sort(key=lambda t: ((-t[0] if mode == "max" else t[0]), -t[1]))
    return [p for _, _, p in ranked[:keep_best]]


def plan(
    paths: Sequence[str], policy: RetentionPolicy, protect: set[str], metrics: Mapping[str, float | None] | None = None
) -> RetentionDecision:
    """The decision for verl's list of saved role dirs (oldest first, the newest complete);
    `protect` holds the absolute paths the tracker names; `metrics` the best_metric value by path."""
    paths = list(paths)
    newest = set(paths if not policy.max_keep or policy.max_keep <= 0 else paths[-policy.max_keep :])
    best = set(best_paths(paths, metrics or {}, policy.keep_best, policy.best_mode))
    tracked = {p for p in paths if absolute(p) in protect}
    decision = RetentionDecision()
    for p in paths:
        if p in newest or p in best or p in tracked:
            decision.keep.append(p)
            if p not in newest and p in best:
                decision.best.append(p)
            elif p not in newest:
                decision.protected.append(p)
        else:
            decision.delete.append(p)
    if policy.optimizer_last is not None:
        with_optimizer = set(decision.keep[-policy.optimizer_last :]) | tracked
        decision.drop_optimizer = [p for p in decision.keep if p not in with_optimizer]
    return decision


# --------------------------------------------------------------------------- disk


def steps_held(policy: RetentionPolicy, peak_steps: tuple[int, int] | None) -> dict[str, int] | None:
    """Role dirs on disk while a new step is written, split into whole ones and ones without their
    optimizer state: `peak_steps` is slimckpt.save.retention.prune.peak_steps(max_keep) (usual, tracker
    behind; None: every step is kept, no bound). The best steps count as extra ones (the worst case:
    none of them among the newest). Before a step is written the tracker names the newest committed
    one, so retention's drops then (slimckpt.save.retention.prune.optimizer_drops) leave the optimizer in
    the newest `optimizer_last` of the steps it keeps and nowhere else."""
    if peak_steps is None:
        return None
    usual, behind = peak_steps
    best = max(0, policy.keep_best)
    committed = usual - 1 + best  # the newest kept (+ the tracker's at max_keep=1) and the best, all complete
    whole = committed
    if policy.optimizer_last is not None:
        keep_n = policy.max_keep or committed
        # a best step is older than the newest: it keeps its optimizer only while the window of the
        # newest optimizer_last reaches it at every pass, the commit's included, where the tracker's
        # step (outside the newest at max_keep=1) takes a place in it
        reach = max(0, policy.optimizer_last - keep_n - (1 if keep_n == 1 else 0))
        whole = min(policy.optimizer_last, keep_n) + min(best, reach)
    return {
        "whole": whole + 1,  # + the step being written
        "without_optimizer": committed - whole,
        "tracker_behind_extra": behind - usual,  # that step keeps its optimizer (the tracker's)
    }


def disk_bytes(step_bytes: int, optimizer_bytes: int, held: dict[str, int] | None) -> dict[str, int] | None:
    """Bytes of `steps_held` for a role whose full step is `step_bytes`, `optimizer_bytes` of it
    optimizer state; the usual peak and the one with the tracker behind."""
    if held is None:
        return None
    usual = held["whole"] * step_bytes + held["without_optimizer"] * (step_bytes - optimizer_bytes)
    return {"usual": usual, "tracker_behind": usual + held["tracker_behind_extra"] * step_bytes}


__all__ = ["BEST_MODES", "RetentionDecision", "RetentionPolicy", "best_paths", "disk_bytes", "plan", "steps_held"]
