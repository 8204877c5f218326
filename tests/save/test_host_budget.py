"""host_memory_budget_gb: auto (slimckpt.save.host_budget): the recipe's default, half of what the node
has available over its local ranks, resolved on the rank at its first save and logged once; a
number always wins. The pool's ranks agree on the smallest budget."""

from __future__ import annotations

import logging

import pytest
import torch

from slimckpt.save import host_budget
from slimckpt.save.modes.writer import AsyncResumeWriter


@pytest.fixture(autouse=True)
def fresh_budget(monkeypatch):
    host_budget.reset()
    yield
    host_budget.reset()


def _meminfo_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def test_auto_is_half_the_available_memory_over_the_local_ranks():
    assert host_budget.auto_budget_bytes(64 * 2**30, 8) == 4 * 2**30
    assert host_budget.auto_budget_bytes(64 * 2**30, 0) == 32 * 2**30  # no rank count: the node is one rank's
    assert host_budget.auto_budget_bytes(-5, 4) == 0


def test_auto_resolves_from_this_node_once_and_logs_it(monkeypatch, caplog):
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    config = SlimCheckpointConfig(
        recipe="incremental", incremental_save=True, async_save="stream", host_memory_budget_gb="AUTO"
    )
    assert config.host_memory_budget_gb == "auto"
    before = _meminfo_available()
    with caplog.at_level(logging.INFO, logger="slimckpt"):
        first = host_budget.budget_bytes(config)
        second = host_budget.budget_bytes(config)
    after = _meminfo_available()
    # the machine is shared: its available memory moves between the reads around the call
    lo, hi = sorted((before, after))
    assert host_budget.auto_budget_bytes(int(lo * 0.9), 4) <= first <= host_budget.auto_budget_bytes(int(hi * 1.1), 4)
    assert second == first  # resolved once per process: a pool sized at the first save stays valid
    lines = [r.getMessage() for r in caplog.records if "host_memory_budget_gb=auto" in r.getMessage()]
    assert len(lines) == 1 and "over 4 local ranks" in lines[0]


def test_auto_is_logged_by_the_first_rank_of_a_node_only(monkeypatch, caplog):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with caplog.at_level(logging.INFO, logger="slimckpt"):
        assert host_budget.budget_bytes(type("C", (), {"host_memory_budget_gb": "auto"})()) > 0
    assert not [r for r in caplog.records if "host_memory_budget_gb=auto" in r.getMessage()]


def test_a_number_wins_and_is_used_as_given(monkeypatch):
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    config = SlimCheckpointConfig(
        recipe="incremental", incremental_save=True, async_save=True, host_memory_budget_gb="1.5"
    )
    assert config.host_memory_budget_gb == 1.5
    assert host_budget.budget_bytes(config) == int(1.5 * 2**30)


def test_the_incremental_recipe_defaults_to_auto_for_both_roles():
    from omegaconf import OmegaConf

    from slimckpt.verl.dryrun import compose_config

    cfg = compose_config(["+recipe=incremental"])
    assert OmegaConf.select(cfg, "actor_rollout_ref.actor.checkpoint.host_memory_budget_gb") == "auto"
    assert OmegaConf.select(cfg, "critic.checkpoint.host_memory_budget_gb") == "auto"
    cfg = compose_config(["+recipe=incremental", "actor_rollout_ref.actor.checkpoint.host_memory_budget_gb=32"])
    assert OmegaConf.select(cfg, "actor_rollout_ref.actor.checkpoint.host_memory_budget_gb") == 32


def _state(n: int) -> dict:
    return {"model": {"w": torch.randn(n)}, "optim": {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]}}


def test_pool_stages_within_an_auto_budget_and_streams_over_a_small_one(tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    auto = type("C", (), {"host_memory_budget_gb": "auto"})()
    writer = AsyncResumeWriter()
    assert writer.stage(_state(1000), auto, step=1) is not None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = dist.new_group(backend="gloo")
        # an explicit budget below the state (4000 bytes): the pool is refused, the save streams
        small = type("C", (), {"host_memory_budget_gb": 1000 * 4 / 2 / 2**30})()
        assert writer.stage(_state(1000), small, step=2, group=group) is None
        assert writer.stage(_state(1000), auto, step=3, group=group) is not None
    finally:
        dist.destroy_process_group()
