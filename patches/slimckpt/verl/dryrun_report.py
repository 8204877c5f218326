"""What `slimckpt dryrun` reports and how it reads a composed config: its error (one line), the
report of the checks that ran, and the readers of a composed config's values. omegaconf only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from slimckpt import SlimckptError


class DryRunError(SlimckptError):
    """A config that verl would reject (or Hydra could not compose); str() is the one-line reason,
    `details` optional extra lines (e.g. the available recipes)."""

    def __init__(self, reason: str, details: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.details = details


@dataclass
class Report:
    """What validation did; `notes` are checks that could not run here and why."""

    checks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    verl_output: list[str] = field(default_factory=list)


def one_line(text: str) -> str:
    # Hydra appends the whole search path to some messages: useful once, noise in one line
    text = text.split("\nConfig search path:")[0]
    parts = [p.strip() for p in text.strip().splitlines() if p.strip()]
    return " ".join(parts)


def select(cfg, key: str, default: Any = None) -> Any:
    """The value at dotted `key` of a composed config, or `default` where it is missing."""

    return OmegaConf.select(cfg, key, default=default, throw_on_missing=False)


def plain(node) -> Any:
    """A config node as plain dicts and lists, interpolations resolved (None stays None)."""

    return OmegaConf.to_container(node, resolve=True) if node is not None else None
