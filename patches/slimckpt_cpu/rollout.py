"""verl rollout backend `hf` (actor_rollout_ref.rollout.name=hf): the two halves verl expects.

- `HFReplica` (a verl RolloutReplica, in RolloutReplicaRegistry as "hf"): starts one
  HFRolloutServer Ray actor per replica; the agent loop sends it token-in/token-out requests.
- `HFServerAdapter` (a verl BaseRollout, in verl's rollout class table as ("hf", "async")): lives in
  each hybrid actor worker; on `update_weights` it gathers the actor's full tensors (every rank
  must take part: FSDP2 gathers them collectively) and the replica's first rank pushes them to
  its server.
"""

# lazy imports: the server's module (transformers) only in the Ray actor a replica starts
from __future__ import annotations

import os
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica
from verl.workers.rollout.utils import ensure_async_iterator

NAME = "hf"


def server_name(replica_rank: int) -> str:
    return f"slimckpt_hf_server_{replica_rank}"


def _replica_world_size(config: Any) -> int:
    return (
        int(config.tensor_model_parallel_size)
        * int(config.data_parallel_size)
        * int(config.pipeline_model_parallel_size)
    )


class HFReplica(RolloutReplica):
    async def launch_servers(self) -> None:
        from slimckpt_cpu.hf_server import HFRolloutServer

        override = dict(self.model_config.get("override_config", {}) or {})
        name = server_name(self.replica_rank)
        if self.is_reward_model or self.is_teacher_model:
            raise NotImplementedError("the hf rollout serves the policy only (no reward or teacher model)")
        self.servers = [
            ray.remote(HFRolloutServer)
            .options(name=name, num_cpus=0, max_concurrency=self.max_concurrency)
            .remote(
                config=self.config,
                model_path=os.path.expanduser(self.model_config.path),
                replica_rank=self.replica_rank,
                attn_implementation=override.get("attn_implementation", "sdpa"),
            )
        ]
        self._server_handle = self.servers[0]
        self._server_address = name  # the load balancer keys servers by this string

    def rollout_worker_use_gpu(self) -> bool:
        return False


class HFServerAdapter(BaseRollout):
    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ["RANK"])
        world = _replica_world_size(self.config)
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self._server: ray.actor.ActorHandle | None = None

    def _server_handle(self) -> ray.actor.ActorHandle:
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    @torch.no_grad()
    async def update_weights(
        self, weights: Any, global_steps: int | None = None, wire_format: str = "named_tensors", **kwargs: Any
    ) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"hf rollout: wire_format={wire_format!r} (only named_tensors)")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("hf rollout: LoRA adapters are not supported; set model.lora.merge=true")
        state: dict[str, torch.Tensor] = {}
        async for name, tensor in ensure_async_iterator(weights):
            if self.rollout_rank == 0:
                state[name] = tensor.detach().to("cpu").clone()
        if self.rollout_rank == 0:
            await self._server_handle().update_weights.remote(state, global_steps)
