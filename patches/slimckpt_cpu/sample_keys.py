"""Carry each trajectory's identity from verl's agent loop to the `hf` rollout server.

verl's agent loop knows which (step, sample index, rollout n) a generation belongs to, but its
request to the server carries only a random request id. `wrap_run_agent_loop` puts the identity
in a context variable around each trajectory; `wrap_client_generate` (the LLM client, running
inside that trajectory's task) adds it to the request as `sample_key`, which the hf server turns
into that sample's private RNG seed. Other rollout backends never see the extra argument.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

from slimckpt_cpu.sampling import SampleKey

_current: contextvars.ContextVar[SampleKey | None] = contextvars.ContextVar("slimckpt_sample_key", default=None)


def _as_int(value: Any) -> int:
    if hasattr(value, "item"):
        value = value.item()
    if hasattr(value, "data") and not isinstance(value, (int, float)):
        value = value.data
    return int(value)


def key_from_trajectory(trajectory: dict, kwargs: dict) -> SampleKey:
    # v1's agent loop passes one trajectory per prompt and numbers the n rollouts by session_id;
    # the legacy loop repeats the prompt n times and numbers them by rollout_n.
    rollout_n = kwargs.get("session_id", trajectory.get("rollout_n", 0))
    return SampleKey(
        step=_as_int(trajectory.get("step", -1)),
        sample_index=_as_int(trajectory.get("sample_index", 0)),
        rollout_n=_as_int(rollout_n),
        validate=bool(trajectory.get("validate", False)),
    )


def wrap_run_agent_loop(original: Callable) -> Callable:
    @functools.wraps(original)
    async def _run_agent_loop(self, sampling_params, trajectory, *args, **kwargs):
        token = _current.set(key_from_trajectory(trajectory, kwargs))
        try:
            return await original(self, sampling_params, trajectory, *args, **kwargs)
        finally:
            _current.reset(token)

    return _run_agent_loop


def wrap_client_generate(original: Callable) -> Callable:
    @functools.wraps(original)
    async def generate(self, request_id, **kwargs):
        key = _current.get()
        if key is not None and "sample_key" not in kwargs and _is_hf(self):
            kwargs["sample_key"] = key.as_dict()
        return await original(self, request_id, **kwargs)

    return generate


def _is_hf(client: Any) -> bool:
    try:
        return client.config.actor_rollout_ref.rollout.name == "hf"
    except AttributeError:
        return False
