"""Check and time async_save's GPU paths on one CUDA device: `python -m slimckpt_testing.gpu_check`.

Needs only torch and this package (scripts/gpu_check.sh sets PYTHONPATH=patches); imports nothing
of verl, runs in about a minute, exits 2 with one line when no CUDA device is visible.

Checks (each PASS/FAIL, exit 1 on any FAIL):
  staged_bytes_equal   StagingPool.stage of a shard-like state (fp32 and bf16 tensors, odd sizes,
                       an empty tensor, AdamW's CPU `step`, hyper-parameters) gives host copies equal
                       to the device tensors as of the stage call, although the "training" stream
                       overwrites every source right after stage returns (ordering by event)
  pool_reused          a second save refills the same pinned buffers and sees the new values
  pinned               the pool is page-locked
  exact_storages       every staged tensor owns a storage of exactly its bytes (no power-of-two rounding
                       of pinned blocks; DCP writes it without cloning it first)
  dtensor              a DTensor (1-rank mesh, gloo, no network) is staged as a DTensor with its spec
  stream_*             async_save=stream (slimckpt_testing.gpu_check_stream): side-stream reads into pinned
                       memory, the guard's copy before an in-place update, the version check
  offload_*, reload_*  async_save=stream under verl's param/optimizer offload (the same module): the
                       save's offload releases the device, the writer reads the offload's host copies,
                       a reload keeps the unread ones and the update cannot reach them
  fsdp*                the incremental tier's save path on FSDP1 and FSDP2 (slimckpt_testing.gpu_check_fsdp; two
                       ranks sharing the GPU over gloo): the state dict round-trips through its DCP
                       writer bit-equal; FSDP1's is a copy of the rank's shards (the device memory it adds
                       is measured), FSDP2's is views that add no device memory
Timings: pageable vs pinned device-to-host copy (GB/s), side-stream overlap of a copy with
matmuls on the training stream, staging (host-blocking seconds and until the copies are done, first
save with pool allocation and a reused pool).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from slimckpt.save.modes.writer import StagingPool, local_tensor, state_bytes, tensors_in
from slimckpt_testing.gpu_check_fsdp import check_fsdp_save
from slimckpt_testing.gpu_check_stream import check_stream, check_stream_offload

NO_CUDA = 2


def _sync() -> None:
    torch.cuda.synchronize()


def _timed(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def shard_like_state(total_bytes: int, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """A model + AdamW state the shape of an FSDP rank's shard, about `total_bytes` on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)
    rows = max(1, total_bytes // (3 * 4 * 4096 * 6))  # 6 fp32 matrices x 3 (param, exp_avg, exp_avg_sq)
    shapes = [(rows, 4096), (rows + 7, 4096), (rows, 1024 + 3), (4096,), (0,), (rows // 2 + 1, 4096)]
    model, state = {}, {}
    for i, shape in enumerate(shapes):
        dtype = torch.bfloat16 if i == 2 else torch.float32
        model[f"layers.{i}.weight"] = torch.randn(shape, generator=g, device=device).to(dtype)
        state[i] = {
            "step": torch.tensor(float(i + 1)),  # AdamW keeps `step` on the CPU
            "exp_avg": torch.randn(shape, generator=g, device=device).to(dtype),
            "exp_avg_sq": torch.rand(shape, generator=g, device=device).to(dtype),
        }
    optim = {"state": state, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "params": list(range(len(shapes)))}]}
    return {"model": model, "optim": optim}


def _pairs(a: Any, b: Any):
    if isinstance(a, torch.Tensor):
        yield a, b
    elif isinstance(a, dict):
        for k in a:
            yield from _pairs(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        for x, y in zip(a, b):
            yield from _pairs(x, y)


def _equal(staged: Any, reference: Any) -> bool:
    for s, r in _pairs(staged, reference):
        s, r = local_tensor(s), local_tensor(r)
        if s.device.type != "cpu" or s.dtype != r.dtype or s.shape != r.shape:
            return False
        if not torch.equal(s, r.cpu()):  # exact, element by element (the data has no NaN)
            return False
    return True


def _overwrite(state: dict[str, Any]) -> None:
    """What an optimizer step does to the sources: in-place, on the training stream."""
    for t in tensors_in(state):
        if t.device.type == "cuda" and t.numel():
            t.add_(1)


def check_staging(device: torch.device, total_bytes: int) -> tuple[dict[str, bool], dict[str, float]]:
    checks, times = {}, {}
    state = shard_like_state(total_bytes, device)
    nbytes = state_bytes(state)
    reference = _clone(state)
    pool = StagingPool()
    _sync()
    t0 = time.perf_counter()
    staged = pool.stage(state)
    times["stage_first_blocking_s"] = time.perf_counter() - t0
    _overwrite(state)  # queued right behind the copies: must not reach the staged bytes
    pool.wait_ready()
    times["stage_first_ready_s"] = time.perf_counter() - t0
    checks["staged_bytes_equal"] = _equal(staged, reference)
    checks["pinned"] = all(t.is_pinned() for t in tensors_in(staged) if t.numel())
    checks["exact_storages"] = pool.nbytes == nbytes and all(
        local_tensor(t).untyped_storage().nbytes() == local_tensor(t).numel() * local_tensor(t).element_size()
        for t in tensors_in(staged)
    )
    times["pool_bytes"] = float(pool.nbytes)

    before = [t.data_ptr() for t in tensors_in(staged)]
    _sync()
    reference = _clone(state)
    blocking, ready = [], []
    for _ in range(3):
        _sync()
        t0 = time.perf_counter()
        staged = pool.stage(state)
        blocking.append(time.perf_counter() - t0)
        pool.wait_ready()
        ready.append(time.perf_counter() - t0)
    checks["pool_reused"] = [t.data_ptr() for t in tensors_in(staged)] == before and _equal(staged, reference)
    times["stage_reused_blocking_s"] = statistics.median(blocking)
    times["stage_reused_ready_s"] = statistics.median(ready)
    times["stage_bytes"] = float(nbytes)
    times["stage_reused_gb_s"] = nbytes / statistics.median(ready) / 1e9
    return checks, times


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_clone(v) for v in state)
    return state


def check_dtensor(device: torch.device) -> bool | str:
    """A DTensor on a 1-rank mesh is staged as a DTensor with the same placements."""
    store = os.path.join(tempfile.mkdtemp(prefix="slimckpt-gpu-check-"), "store")
    try:
        backend = "cpu:gloo,cuda:nccl" if dist.is_nccl_available() else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
        mesh = init_device_mesh("cuda", (1,))
        full = torch.randn(64, 32, device=device)
        dt = distribute_tensor(full, mesh, [Shard(0)])
        pool = StagingPool()
        staged = pool.stage({"w": dt})
        pool.wait_ready()
        out = staged["w"]
        return (
            isinstance(out, DTensor)
            and out.placements == dt.placements
            and out.to_local().is_pinned()
            and torch.equal(out.to_local(), full.cpu())
        )
    except Exception as exc:  # noqa: BLE001 - reported, not fatal: the plain-tensor path is checked above
        return f"error: {type(exc).__name__}: {exc}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def time_copies(device: torch.device, nbytes: int) -> dict[str, float]:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    pageable = torch.empty(src.shape, dtype=src.dtype)
    pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    out = {"copy_bytes": float(nbytes)}
    out["d2h_pageable_gb_s"] = nbytes / _timed(lambda: pageable.copy_(src)) / 1e9
    out["d2h_pinned_gb_s"] = nbytes / _timed(lambda: pinned.copy_(src, non_blocking=True)) / 1e9

    side = torch.cuda.Stream(device=device)
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    t_copy = _timed(lambda: _on(side, lambda: pinned.copy_(src, non_blocking=True)))
    per_mm = _timed(lambda: a @ a)
    n_mm = max(1, int(t_copy / max(per_mm, 1e-6)))  # compute about as long as the copy

    def compute() -> None:
        for _ in range(n_mm):
            a @ a

    t_compute = _timed(compute)

    def both() -> None:
        compute()  # queued on the training stream
        _on(side, lambda: pinned.copy_(src, non_blocking=True))

    t_both = _timed(both)
    out.update(
        side_copy_s=t_copy,
        compute_s=t_compute,
        both_s=t_both,
        overlap=max(0.0, (t_copy + t_compute - t_both) / min(t_copy, t_compute)),
    )
    return out


def _on(stream, fn) -> None:
    with torch.cuda.stream(stream):
        fn()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m slimckpt_testing.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--gib", type=float, default=1.0, help="size of the staged state and of the timed copy (GiB)")
    p.add_argument("--json", default="gpu_check.json", help="where to write the results")
    p.add_argument(
        "--fsdp-hidden",
        type=int,
        default=2048,
        help="hidden size of the FSDP save check's model (4 blocks; 2048: ~0.1B parameters)",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device visible (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
            "this check needs one NVIDIA GPU. Nothing was run.",
            file=sys.stderr,
        )
        return NO_CUDA
    device = torch.device("cuda", torch.cuda.current_device())
    nbytes = int(args.gib * 2**30)
    started = time.perf_counter()
    checks, times = check_staging(device, nbytes)
    dtensor = check_dtensor(device)
    checks["dtensor"] = dtensor is True
    stream_checks, stream_times = check_stream(device, nbytes, shard_like_state, _clone, _overwrite)
    checks.update(stream_checks)
    times.update(stream_times)
    offload_checks, offload_times = check_stream_offload(device, nbytes)
    checks.update(offload_checks)
    times.update(offload_times)
    times.update(time_copies(device, nbytes))
    fsdp_checks, fsdp_figures = check_fsdp_save("cuda", hidden=args.fsdp_hidden)
    checks.update(fsdp_checks)
    result = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "checks": checks,
        "dtensor_detail": None if dtensor is True else str(dtensor),
        "timings": times,
        "fsdp_save": fsdp_figures,
        "seconds": time.perf_counter() - started,
    }
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"slimckpt gpu_check on {result['device']} (torch {result['torch']}, CUDA {result['cuda']})")
    print(f"{'check':<22} result")
    for name, ok in checks.items():
        print(f"{name:<22} {'PASS' if ok else 'FAIL'}" + (f"  ({dtensor})" if name == "dtensor" and not ok else ""))
    t = times
    print(f"\n{'timing':<40} value")
    rows = [
        ("D2H pageable", f"{t['d2h_pageable_gb_s']:.1f} GB/s"),
        ("D2H pinned (non_blocking)", f"{t['d2h_pinned_gb_s']:.1f} GB/s"),
        ("side-stream copy alone", f"{t['side_copy_s'] * 1e3:.1f} ms"),
        ("matmuls alone (training stream)", f"{t['compute_s'] * 1e3:.1f} ms"),
        ("both at once", f"{t['both_s'] * 1e3:.1f} ms (overlap {100 * t['overlap']:.0f}%)"),
        (f"stage {t['stage_bytes'] / 2**30:.2f} GiB, first: blocking", f"{t['stage_first_blocking_s'] * 1e3:.1f} ms"),
        ("stage, first: until copied", f"{t['stage_first_ready_s'] * 1e3:.1f} ms (pool allocation included)"),
        ("stage, reused pool: blocking", f"{t['stage_reused_blocking_s'] * 1e3:.1f} ms"),
        (
            "stage, reused pool: until copied",
            f"{t['stage_reused_ready_s'] * 1e3:.1f} ms ({t['stage_reused_gb_s']:.1f} GB/s)",
        ),
        ("stream: writer reads alone", f"{t['stream_read_alone_s'] * 1e3:.1f} ms"),
        (
            "stream: reads + matmuls at once",
            f"{t['stream_read_with_compute_s'] * 1e3:.1f} ms (matmuls alone {t['compute_alone_s'] * 1e3:.1f} ms)",
        ),
        (
            "stream: guard copy of the unread",
            f"{t['guard_copy_s'] * 1e3:.1f} ms ({t['guard_copied_bytes'] / 2**30:.2f} GiB)",
        ),
        ("offload: verl's round trip alone", f"{t['offload_round_trip_plain_s'] * 1e3:.1f} ms"),
        (
            "offload: followed by a stream write",
            f"{t['offload_following_s'] * 1e3:.1f} ms "
            f"(device bytes over before the save: "
            f"{t['device_bytes_after_offload_over_before_save'] / 2**20:.1f} MiB)",
        ),
        (
            "offload: reload keeps unread copies",
            f"{t['held_bytes'] / 2**30:.2f} GiB held, RssAnon +{t['held_rss_extra_bytes'] / 2**30:.2f} GiB",
        ),
    ]
    for version in (1, 2):
        ranks = fsdp_figures.get(f"fsdp{version}")
        if not ranks:
            rows.append((f"FSDP{version} save", fsdp_figures.get(f"fsdp{version}_error", "not run")))
            continue
        r = max(ranks, key=lambda x: x["device_added"] or 0)
        rows.append(
            (
                f"FSDP{version} state dict: device added",
                f"{(r['device_added'] or 0) / 2**20:.1f} MiB of a "
                f"{r['shard_bytes'] / 2**20:.1f} MiB shard (copy {r['copied_bytes'] / 2**20:.1f} MiB), "
                f"{r['state_dict_s'] * 1e3:.0f} ms; write {r['write_s']:.2f} s",
            )
        )
    for name, value in rows:
        print(f"{name:<40} {value}")
    print(f"\nwrote {args.json} in {result['seconds']:.1f} s")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    from slimckpt.log import cli_logging

    with cli_logging():
        sys.exit(main())
