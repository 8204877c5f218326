"""slimckpt_cpu.batch_order: a step's trajectories come out in dataloader order, whatever order the
rollouts finished in (feature "cpu"), so two runs of one config repeat bit for bit."""

import random
from types import SimpleNamespace

from slimckpt_cpu.batch_order import trajectory_order, wrap_materialize_batch


def test_order_by_prompt_rank_then_session_then_index():
    rank = {"b-2": 0, "a-1": 1}
    keys = ["a-1_0_0", "b-2_1_0", "b-2_0_1", "odd", "b-2_10_0", "b-2_2_0", "a-1_1_0"]
    assert sorted(keys, key=trajectory_order(rank)) == [
        "b-2_0_1",
        "b-2_1_0",
        "b-2_2_0",
        "b-2_10_0",
        "a-1_0_0",
        "a-1_1_0",
        "odd",
    ]


def test_materialize_sees_the_same_order_for_any_completion_order():
    prompts = [f"uid{i}-x" for i in range(4)]
    trajectories = [f"{p}_{s}_0" for p in prompts for s in range(3)]
    seen = []

    def original(self, partition_id, selected, snapshot):
        seen.append(list(snapshot))
        return list(snapshot)

    materialize = wrap_materialize_batch(original)
    buffer = SimpleNamespace(prompt_global_steps={"train": {p: 1 for p in prompts}})
    for seed in range(5):
        finished = trajectories[:]
        random.Random(seed).shuffle(finished)
        materialize(buffer, "train", prompts, {k: {"status": "success"} for k in finished})
    assert all(order == trajectories for order in seen)
