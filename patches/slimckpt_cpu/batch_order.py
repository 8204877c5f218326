"""A training batch in dataset order, not in the order its rollouts happened to finish.

verl 0.9.1's v1 replay buffer (`ReplayBuffer._materialize_batch`) lists a step's trajectories in
the order the agent loop stored them in TransferQueue, i.e. the order in which generations
finished. That order varies from run to run; it decides how `_balance_batch` splits the batch
over data-parallel ranks and how micro-batches are formed, so two runs of the same config differ
in the last bits of every loss and gradient, and after enough steps in their samples too.

With this patch (feature "cpu", i.e. small runs with SLIMCKPT_CPU=1, where slimckpt's hf rollout
already seeds every sample) a batch is ordered by the prompt's position in the step's dataloader
batch, then by rollout index (session) and output index: the same batch, in the same order, every
run. Together with seeded sampling, two runs of one config log bit-identical curves, which is what
scripts/compare/quality_proof.py relies on to show that a recipe leaves training unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable


def trajectory_order(prompt_rank: dict[str, int]) -> Callable[[str], tuple]:
    """Sort key for TransferQueue trajectory keys `{uid}_{session_id}_{index}`: the prompt's rank,
    then session and index as numbers; keys of another shape go last, in their given order."""

    def key(name: str) -> tuple:
        parts = name.rsplit("_", 2)
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            return (prompt_rank.get(parts[0], math.inf), int(parts[1]), int(parts[2]))
        return (math.inf, math.inf, math.inf)

    return key


def wrap_materialize_batch(original: Callable) -> Callable:
    @functools.wraps(original)
    def _materialize_batch(self, partition_id, selected_prompt_uids, partition_snapshot):
        # prompt_global_steps is filled while listing TransferQueue, where prompts sit in the order the
        # trainer put them: the dataloader's order
        prompt_rank = {uid: i for i, uid in enumerate(self.prompt_global_steps.get(partition_id, {}))}
        order = trajectory_order(prompt_rank)
        ordered = dict(sorted(partition_snapshot.items(), key=lambda item: order(item[0])))
        return original(self, partition_id, selected_prompt_uids, ordered)

    return _materialize_batch
