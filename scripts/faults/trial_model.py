"""The SIGKILL and rank campaigns' training state, the same on every rank: one tiny FSDP2 Llama per role (the actor,
and verl's critic class over it), AdamW, a scheduler and verl's FSDPCheckpointManager; a run's steps (the global
RNG drawn each step, so its saved state matters); and the hashes of each role's saved contents that a resume is
compared with. scripts/faults/trial.py's savers and checkers build it."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

# lazy imports: torch, verl and slimckpt load in the forked children, after the campaign's quiet_imports()

WORLD = 2  # the SIGKILL campaign's; the rank campaign sets its own on scripts.faults.trial
VOCAB = 64
ROLES = ("actor", "critic")


class Model:
    """One role on this rank: a tiny FSDP2 Llama (actor) or verl's critic class on it (a value
    head), AdamW, a scheduler and verl's FSDPCheckpointManager."""

    def __init__(self, role: str, ckpt_config) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import (
            auto_class,
            build_config,
            training_state,
            wrap_fsdp2,
        )

        self.role = role
        args = SimpleNamespace(model="llama", vocab=VOCAB, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2)
        kind = "llama" if role == "actor" else "critic"  # verl's value model (a token classifier, one label)
        model = auto_class(kind).from_config(build_config(args, kind))
        world = dist.get_world_size()  # the group's: the rank campaign runs world sizes 2 and 3
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        self.model = wrap_fsdp2(model, mesh, "dim0", world)
        self.optimizer, self.scheduler, self.manager = training_state(self.model, ckpt_config, VOCAB)

    def step(self, ids) -> None:
        out = self.model(input_ids=ids, labels=ids) if self.role == "actor" else self.model(input_ids=ids)
        (out.loss if self.role == "actor" else out.logits.pow(2).mean()).backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)


class Run:
    """This rank's actor and critic (PPO), each with its own checkpoint config."""

    def __init__(self, seed: int, configs: dict[str, Any]) -> None:
        import torch

        torch.manual_seed(seed)
        self.roles = {role: Model(role, configs[role]) for role in ROLES}

    def step(self) -> None:
        import torch

        for model in self.roles.values():
            model.step(torch.randint(0, VOCAB, (2, 12)))  # the global RNG: its saved state matters


def _tensor_bytes(t) -> bytes:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.detach().contiguous().cpu().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()


def _feed(h, obj) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        h.update(str((tuple(obj.shape), obj.dtype)).encode())
        h.update(_tensor_bytes(obj))
    elif isinstance(obj, dict):
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _feed(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _feed(h, value)
    else:
        h.update(repr(obj).encode())


def content_key(role: str, content: str) -> str:
    """The hash key of one role's content: the actor's are `model`, `optim`, `extra`."""
    return content if role == "actor" else f"{role}_{content}"


def state_hashes(run: Run) -> dict[str, str]:
    """Per-content sha1 of this rank's state, per role: model shards, optimizer state + param
    groups, lr scheduler + torch RNG."""
    import torch

    parts = {}
    for role, m in run.roles.items():
        optim = m.optimizer.state_dict()
        parts.update(
            {
                content_key(role, "model"): m.model.state_dict(),
                content_key(role, "optim"): {
                    "state": optim["state"],
                    "groups": [{k: v for k, v in g.items() if k != "params"} for g in optim["param_groups"]],
                },
                content_key(role, "extra"): {
                    "scheduler": {k: v for k, v in m.scheduler.state_dict().items() if k != "lr_lambdas"},
                    "rng": torch.get_rng_state(),
                },
            }
        )
    out = {}
    for name, obj in parts.items():
        h = hashlib.sha1()
        _feed(h, obj)
        out[name] = h.hexdigest()
    return out
