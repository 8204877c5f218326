#!/usr/bin/env python
"""Which version counters move when user code changes the weights after a save, per FSDP layout.

    torchrun --standalone --nproc_per_node 2 scripts/probe_stream_versions.py [fsdp2 fsdp1 fsdp1_orig]

For each layout (FSDP2 `fully_shard`; FSDP1 with use_orig_params false, verl's default, and true)
a tiny Llama with AdamW (no slimckpt hook) takes the sharded state dict slimckpt's incremental save
writes (slimckpt.save.state_dicts.build_state_dict), then one change at a time is made as user
code makes it, and rank 0 prints, over the state dict's tensors: how many changed value, how many
of those moved the entry's own counter (the DTensor's, or its local tensor's), how many moved a
counter of the live parameter or optimizer state viewing the same memory (async_save=stream's
guard watches both, slimckpt.save.modes.stream_capture), and how many changed with no counter moving.
Also which entries view live memory at all (FSDP1's are copies).
"""

from __future__ import annotations

import copy
import datetime
import functools
import sys
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist

# lazy imports: transformers, FSDP and slimckpt load per layout, once the process group is up

VOCAB = 64


def build(layout: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import AutoModelForCausalLM

    from slimckpt_testing.scenarios import tiny_run
    from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import build_config, wrap_fsdp2

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(tiny_run.tiny_args()))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    if layout == "fsdp2":
        model = wrap_fsdp2(model, mesh, "dim0", dist.get_world_size())
    else:
        layers = {type(m) for m in model.modules() if type(m).__name__.endswith("DecoderLayer")}
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layers)
        model = FSDP(
            model,
            auto_wrap_policy=policy,
            use_orig_params=layout == "fsdp1_orig",
            device_id=torch.device("cpu"),
            device_mesh=mesh,
        )
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def backward(model) -> None:
    ids = torch.randint(0, VOCAB, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()


def leaves(obj, path=""):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{path}[{i}]")


def local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def key(t: torch.Tensor) -> tuple:
    x = local(t)
    return x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.dtype


def counters(t: torch.Tensor) -> list[torch.Tensor]:
    return [t] if local(t) is t else [t, local(t)]


class Snapshot:
    """The state dict's tensors, their values, and the counters of the entries and of the live
    tensors viewing the same memory."""

    def __init__(self, model, optimizer) -> None:
        from slimckpt.save.state_dicts import build_state_dict

        state = build_state_dict(SimpleNamespace(model=model, optimizer=optimizer), model=True, optimizer=True)
        live = list(model.parameters()) + [
            v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ]
        by_key: dict[tuple, list[torch.Tensor]] = {}
        for t in live:
            by_key.setdefault(key(t), []).extend(counters(t))
        self.rows = []
        for name, t in leaves(state):
            own, alive = counters(t), by_key.get(key(t), [])
            self.rows.append(
                (name, t, local(t).detach().clone(), own, [c._version for c in own], alive, [c._version for c in alive])
            )

    def report(self, tag: str) -> None:
        changed = own = alive = neither = viewing = 0
        for _name, t, before, own_t, own_v, alive_t, alive_v in self.rows:
            viewing += bool(alive_t)
            if torch.equal(local(t), before):
                continue
            changed += 1
            moved_own = [c._version for c in own_t] != own_v
            moved_alive = [c._version for c in alive_t] != alive_v
            own += moved_own
            alive += moved_alive
            neither += not (moved_own or moved_alive)
        if dist.get_rank() == 0:
            print(
                f"{tag:44s} of {len(self.rows)} tensors ({viewing} view live memory): {changed} changed; "
                f"entry counter moved {own}, live counter moved {alive}, no counter {neither}",
                flush=True,
            )


def add(how: str):
    def change(model, optimizer) -> None:
        with torch.no_grad():
            for p in model.parameters():
                {
                    "p.add_": lambda: p.add_(1.0),
                    "p.data.add_": lambda: p.data.add_(1.0),
                    "p.to_local().add_": lambda: (p.to_local() if hasattr(p, "to_local") else p).add_(1.0),
                    "p.copy_": lambda: p.copy_(p + 1),
                }[how]()

    return change


def optimizer_step(model, optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def model_load_state_dict(model, optimizer) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    sharded = StateDictOptions(full_state_dict=False)
    other = {k: v.detach() + 0.5 for k, v in get_model_state_dict(model, options=sharded).items()}
    if isinstance(model, torch.distributed.fsdp.FullyShardedDataParallel):
        set_model_state_dict(model, other, options=sharded)  # FSDP1's own load_state_dict takes full tensors
    else:
        model.load_state_dict(other)


def optimizer_load_state_dict(model, optimizer) -> None:
    state = copy.deepcopy(optimizer.state_dict())
    for s in state["state"].values():
        for v in s.values():
            v.add_(0.25)
    optimizer.load_state_dict(state)


def forward_backward(model, optimizer) -> None:
    backward(model)
    optimizer.zero_grad(set_to_none=True)


CHANGES = {
    "p.add_(1.0) under no_grad": add("p.add_"),
    "p.copy_(p + 1)": add("p.copy_"),
    "p.to_local().add_(1.0)": add("p.to_local().add_"),
    "p.data.add_(1.0)": add("p.data.add_"),
    "AdamW step (no hook)": optimizer_step,
    "model load_state_dict": model_load_state_dict,
    "optimizer.load_state_dict": optimizer_load_state_dict,
    "forward + backward (control)": forward_backward,
}


def main() -> int:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    for layout in sys.argv[1:] or ["fsdp2", "fsdp1", "fsdp1_orig"]:
        model, optimizer = build(layout)
        for _ in range(2):
            backward(model)
            optimizer_step(model, optimizer)
        for tag, change in CHANGES.items():
            if tag.startswith("AdamW"):
                backward(model)
            snapshot = Snapshot(model, optimizer)
            change(model, optimizer)
            snapshot.report(f"{layout}: {tag}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
