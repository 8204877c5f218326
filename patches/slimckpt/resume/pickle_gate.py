"""A trainer's load refuses a booby-trapped checkpoint on every rank at once, before it starts.

Each rank checks the pickles its own load would unpickle (read.step_pickles); the ranks then
share what they found, and all raise the lowest rank's refusal (PickleRefused: the file and the
global, one line). A refusal on one rank alone would leave the others waiting in the load's
collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from slimckpt.dist import outcome
from slimckpt.engine.pickle_policy import PickleRefused, trusted


def _refused(failure: outcome.Failure) -> PickleRefused:
    return PickleRefused(*failure.args)


def refuse_together(group: Any, refusals: Callable[[], list[PickleRefused]]) -> None:
    """Raise on every rank of `group` the first of any rank's `refusals()`; return when none has one."""
    if trusted():
        return
    mine = refusals()
    # the refusal's fields travel with the failure: every rank raises the same PickleRefused
    first = mine[0] if mine else None
    failure = (
        outcome.Failure(dist.get_rank(group), str(first), args=(first.path, first.global_name, first.part))
        if first
        else None
    )
    outcome.agree(group, failure, _refused)
