"""The incremental tier's save path under FSDP1 and FSDP2, for gpu_check (and on CPU for the tests).

Two ranks (spawned processes sharing the device, gloo: no network, no second GPU needed) wrap the
same stack of blocks with FSDP1 (FullyShardedDataParallel per block, use_orig_params, as verl's
strategy=fsdp) or FSDP2 (fully_shard per block, as strategy=fsdp2), give AdamW its state, and take
the save's state dict exactly as the incremental tier does (build_state_dict: model + optimizer, sharded,
on the tensors' own device). Then:

  copied_bytes   bytes of state-dict tensors that do not share storage with a live parameter or
                 optimizer tensor: a copy the save holds while it writes (FSDP1: the rank's whole
                 shards, `slimckpt plan`'s "device added"; FSDP2: none)
  device_added   on CUDA, torch's peak allocated bytes during build_state_dict above the level before
  roundtrip      the state dict written by the incremental tier's DCP writer (save.step_write.storage_writer)
                 and read back into a fresh state dict is bit-equal to it

Needs only torch and this package (no verl, no transformers): tests/save/test_engine_without_verl.py
runs it where verl, Ray, omegaconf and hydra cannot be imported.
"""

# lazy imports: the incremental tier's state dicts and writer (DCP) load inside a rank only
from __future__ import annotations

import gc
import json
import os
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from slimckpt.save.modes.writer import tensors_in

BLOCKS = 4


class Block(torch.nn.Sequential):
    """One FSDP unit, as a decoder layer is one in verl's wrap."""


def _model(hidden: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # every rank builds the same weights: nothing to sync (as on CPU for FSDP1)
    blocks = [
        Block(torch.nn.Linear(hidden, 3 * hidden + 5), torch.nn.GELU(), torch.nn.Linear(3 * hidden + 5, hidden))
        for _ in range(BLOCKS)
    ]
    return torch.nn.Sequential(torch.nn.Embedding(257, hidden), *blocks, torch.nn.Linear(hidden, 257)).to(device)


def _wrap(model: torch.nn.Module, fsdp: int, device: torch.device) -> torch.nn.Module:
    blocks = [m for m in model if isinstance(m, Block)]
    if fsdp == 2:
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        use_orig_params=True,
        device_id=device,
    )


def _live_storages(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    live = [*model.parameters(), *model.buffers(), *tensors_in(optimizer.state)]
    if hasattr(model, "_fsdp_wrapped_module") or any(hasattr(m, "_handle") for m in model.modules()):
        live += [m._handle.flat_param for m in FSDP.fsdp_modules(model) if getattr(m, "_handle", None) is not None]
    out = set()
    for t in live:
        local = t.to_local() if hasattr(t, "to_local") else t
        if isinstance(local, torch.Tensor) and local.numel():
            out.add(local.untyped_storage().data_ptr())
    return out


def _locals(state: Any):
    for t in tensors_in(state):
        if hasattr(t, "local_shards"):  # ShardedTensor (FSDP1)
            yield from (s.tensor for s in t.local_shards())
        else:
            yield t.to_local() if hasattr(t, "to_local") else t


def copied_bytes(state: Any, live: set[int]) -> int:
    """Bytes of the state dict's tensors (one count per storage) that no live tensor shares."""
    seen: set[int] = set()
    total = 0
    for t in _locals(state):
        if not t.numel() or t.dim() == 0:  # AdamW's step: a scalar, copied by every path
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in live or ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total


def _equal(a: Any, b: Any) -> bool:
    la, lb = list(_locals(a)), list(_locals(b))
    return len(la) == len(lb) and all(x.shape == y.shape and torch.equal(x.cpu(), y.cpu()) for x, y in zip(la, lb))


def rank_main(rank: int, world: int, fsdp: int, device_type: str, hidden: int, init_file: str, out_dir: str) -> None:
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = _check_rank(rank, fsdp, device, device_type, hidden, out_dir)
        # the wrapped model and its optimizer live in reference cycles: free them now, while the group and the
        # interpreter are whole (a collective's work freed during the interpreter's exit aborts the process),
        # and leave together, so no rank closes its connections while another still uses them
        gc.collect()
        dist.barrier()
        with open(os.path.join(out_dir, f"fsdp{fsdp}_rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _check_rank(
    rank: int, fsdp: int, device: torch.device, device_type: str, hidden: int, out_dir: str
) -> dict[str, Any]:
    """This rank's figures: the save's state dict taken, written and read back."""
    from slimckpt.save.state_dicts import build_state_dict
    from slimckpt.save.step_write import storage_writer

    model = _wrap(_model(hidden, device), fsdp, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # a step on zero gradients creates the state without a backward pass
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for st in optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                local = st[key].to_local() if hasattr(st[key], "to_local") else st[key]
                local.uniform_(0.0, 1.0)
    manager = SimpleNamespace(model=model, optimizer=optimizer)
    shard = sum(t.numel() * t.element_size() for t in _locals({"m": list(model.parameters())}))
    shard += sum(t.numel() * t.element_size() for t in _locals(optimizer.state) if t.dim())
    if device_type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    state = build_state_dict(manager, model=True, optimizer=True)
    state_dict_s = time.perf_counter() - started
    added = torch.cuda.max_memory_allocated(device) - before if device_type == "cuda" else None
    copied = copied_bytes(state, _live_storages(model, optimizer))
    path = os.path.join(out_dir, f"fsdp{fsdp}_dcp")
    started = time.perf_counter()
    dcp.save(state, storage_writer=storage_writer(path, SimpleNamespace(write_threads=1, bucket_mb=16)))
    write_s = time.perf_counter() - started
    fresh = build_state_dict(manager, model=True, optimizer=True, optimizer_state=True)
    reference = {k: _clone(v) for k, v in state.items()}
    with torch.no_grad():  # the template must change for the read-back to prove anything
        for t in _locals(fresh):
            if t.is_floating_point() and t.dim():
                t.zero_()
    dcp.load(fresh, checkpoint_id=path)
    result = {
        "rank": rank,
        "fsdp": fsdp,
        "shard_bytes": shard,
        "copied_bytes": copied,
        "device_added": added,
        "roundtrip": _equal(fresh, reference),
        "state_dict_s": state_dict_s,
        "write_s": write_s,
    }
    return result


def _clone(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if hasattr(value, "local_shards"):
        return [s.tensor.detach().clone() for s in value.local_shards()]
    if hasattr(value, "to_local"):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def check_fsdp_save(device_type: str, hidden: int = 512, world: int = 2) -> tuple[dict[str, bool], dict[str, Any]]:
    """Both FSDP versions, `world` spawned ranks each; the checks and the per-version figures."""
    checks: dict[str, bool] = {}
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="slimckpt-fsdp-check-") as tmp:
        for fsdp in (1, 2):
            init = os.path.join(tmp, f"init{fsdp}")
            try:
                mp.spawn(rank_main, args=(world, fsdp, device_type, hidden, init, tmp), nprocs=world, join=True)
            except Exception as exc:  # noqa: BLE001 - a rank's failure is this check's result, in one line
                checks[f"fsdp{fsdp}_save_ran"] = False
                figures[f"fsdp{fsdp}_error"] = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]
                continue
            ranks = [json.load(open(os.path.join(tmp, f"fsdp{fsdp}_rank{r}.json"))) for r in range(world)]
            figures[f"fsdp{fsdp}"] = ranks
            checks[f"fsdp{fsdp}_dcp_roundtrip"] = all(r["roundtrip"] for r in ranks)
        if len([k for k in figures if not k.endswith("_error")]) < 2:
            return checks, figures
        one, two = figures["fsdp1"], figures["fsdp2"]
        # FSDP1: a copy of (nearly) the whole shard; FSDP2: none (views of the live shards)
        checks["fsdp1_state_dict_is_a_copy"] = all(r["copied_bytes"] >= 0.9 * r["shard_bytes"] for r in one)
        checks["fsdp2_state_dict_is_views"] = all(r["copied_bytes"] == 0 for r in two)
        if device_type == "cuda":
            checks["fsdp2_adds_no_device_copy"] = all(r["device_added"] < 0.05 * r["shard_bytes"] for r in two)
    return checks, figures
