"""async_save=stream under verl's param_offload + optimizer_offload, through verl's real
FSDPCheckpointManager and FSDPEngine.save_checkpoint (FSDP2, gloo, CPU, 2 ranks):

    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.stream_offload --dir D

tests/save/test_stream_offload.py asserts on D/offload_result.json.

The device move on a CPU: verl's offload and reload copy each tensor to the other device and drop
the old one, and CPU-to-CPU `.to("cpu")` is a no-op, so the double below moves storage for real
(new tensors, the old storage released): verl's own offload_fsdp_model_to_cpu and
load_fsdp_model_to_gpu run with their FSDP2 move (`model.to(device)`) done as `model._apply` of a
copy, which is what `.to` of another device does to an FSDP2 module; the optimizer's pair is
verl's loop with the copy for `.to`, in place of verl's functions before slimckpt wraps them.
Training runs the engine's order (FSDPEngine.to around the update: reload model and optimizer,
step, offload both); the save is FSDPEngine.save_checkpoint (reload the model, save, offload it).

1. equal: a sync save of step 3, then a stream save of it with the writer paused at its second
   read; the save's offload must leave no device tensor alive but the one the paused read holds
   (where the writer reached its pause before the offload, DCP's planner looked that tensor up
   before the read began), and none once the write has ended; the next update (reload, step,
   offload) runs with the writer still paused: its guard copies nothing; then the write ends. Every
   file equals the sync save's; a fresh run loads the stream step: bitwise-equal losses.
2. held: the writer paused across the reload; the new device parameters are then changed in
   place with no guard at all: the step commits the saved values (the write reads the host copies
   the reload dropped), equal to a sync save.
3. raced: the offloaded host copy changed in place before the writer read it (on every rank, and
   through to_local() on rank 1 only): the step fails on every rank in one line naming the tensor.
4. memory: sampled RssAnon of each rank from the save to the end of the write and the next update,
   over what it held before, for the update alone, a sync save, a stream save with a rollout window
   longer than the write, one with none (the update right after the save: what it reloads before
   the writer has read it stays alive) and a pool save, in that order (the pool is held for the run).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist

import slimckpt_testing.scenarios.tiny_run as tiny_run

from .stream import PauseAt, same_step

# lazy imports: verl's engine and slimckpt's stream capture load inside a phase, after the device double is installed

MANIFEST = "slimckpt_resume.json"
DEVICE_STORAGES: dict = {}  # name -> weak reference to the storage of each tensor the last reload made


def _move(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


def _reload_model(model, *_):
    from torch.multiprocessing.reductions import StorageWeakRef

    model._apply(_move)
    DEVICE_STORAGES.clear()
    DEVICE_STORAGES.update(
        (name, StorageWeakRef(getattr(t, "_local_tensor", t).untyped_storage()))
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    )


def _offload_optimizer(optimizer):
    if not optimizer.state:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = _move(value)


def _load_optimizer(optimizer, device_id):
    _offload_optimizer(optimizer)


def install_device_double() -> None:
    from verl.utils import fsdp_utils
    from verl.workers.engine.fsdp import transformer_impl as ti

    if ti.offload_fsdp_optimizer is not fsdp_utils.offload_fsdp_optimizer:
        raise RuntimeError("stream offload scenario: slimckpt wrapped verl's offload before the double was set")
    fsdp_utils.offload_fsdp2_model_to_cpu = lambda model, empty_cache=True: model._apply(_move)
    fsdp_utils.load_fsdp2_model_to_gpu = _reload_model
    ti.offload_fsdp_optimizer, ti.load_fsdp_optimizer = _offload_optimizer, _load_optimizer


def _engine(run):
    """verl's FSDP engine around the run's model, optimizer and checkpoint manager, offloading both
    (only what its save_checkpoint reads is set)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    engine = FSDPEngine.__new__(FSDPEngine)
    engine.module, engine.optimizer, engine.checkpoint_manager = run.model, run.optimizer, run.manager
    engine._is_offload_param = engine._is_offload_optimizer = True
    engine._uses_fsdp2_cpu_offload_policy = False
    return engine


def update(run, change=None) -> float:
    """One update in the engine's order with both offloads: FSDPEngine.to(device), the step,
    FSDPEngine.to("cpu"); `change(run)` right after the reload."""
    from verl.workers.engine.fsdp import transformer_impl as ti

    ti.load_fsdp_model_to_gpu(run.model)
    ti.load_fsdp_optimizer(run.optimizer, "cpu")
    if change is not None:
        change(run)
    loss = run.step()
    ti.offload_fsdp_model_to_cpu(run.model)
    ti.offload_fsdp_optimizer(run.optimizer)
    return loss


def _config(**kw):
    return tiny_run.slim_config(**{"export_hf": True, "export_dtype": "auto", "max_shard_size": "200KB", **kw})


def save(run, root: str, step: int, **kw) -> str:
    path = os.path.join(root, f"global_step_{step}", "actor")
    run.manager.checkpoint_config = _config(**kw)
    _engine(run).save_checkpoint(path, global_step=step)
    return path


def _gather(value) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _paused_stream_save(run, root: str, step: int, nth: int = 2, **kw):
    from slimckpt.save.modes import stream_capture

    pause = PauseAt(nth)
    stream_capture.READ_HOOK = pause
    path = save(run, root, step, async_save="stream", host_memory_budget_gb=1.0, **kw)
    # the writer reads within milliseconds of the save; 120 s is a hang, under the 240 s group timeout
    assert pause.reached.wait(timeout=120), "the stream writer never started reading"
    return path, pause


def _finish(run, pause) -> str | None:
    from slimckpt.save.modes import stream_capture
    from slimckpt.save.modes.writer import writer_for
    from slimckpt.verl.manager_state import state_of

    pause.release()
    try:
        writer_for(state_of(run.manager)).wait()
        return None
    except RuntimeError as exc:
        return str(exc)
    finally:
        stream_capture.READ_HOOK = None
        dist.barrier()


def phase_equal(run, d: str, result: dict) -> list[float]:
    from slimckpt.save.modes.writer import state_bytes, writer_for
    from slimckpt.verl.manager_state import state_of

    sync = save(run, os.path.join(d, "sync"), tiny_run.SAVE_STEP)
    stream, pause = _paused_stream_save(run, os.path.join(d, "stream"), tiny_run.SAVE_STEP)
    capture = writer_for(state_of(run.manager)).capture
    # the reads in flight besides the paused one (the export reads on its own thread), taken before the
    # device tensors are looked at: a read that ends in between only releases its tensor
    reading = sorted(s.name for s in list(capture._sources.values()) if s.reading)
    gc.collect()
    saved_on_device = dict(DEVICE_STORAGES)  # the next update's reload replaces DEVICE_STORAGES
    device_alive = sorted(name for name, w in saved_on_device.items() if not w.expired())
    model_bytes = state_bytes(dict(run.model.named_parameters()))
    followed = capture.followed_bytes
    reference = [update(run)]  # reload (the sources are held), step, offload, with the writer paused
    rank = {
        "device_tensors": len(saved_on_device),
        "device_alive_after_offload": device_alive,
        "paused_at": pause.name,
        "reading_at_offload": reading,
        "model_bytes": model_bytes,
        "followed_bytes": followed,
        "held_bytes": capture.held_bytes,
        "captured_bytes": capture.nbytes,
        "guard_copied_bytes": capture.copied_bytes,
        "guards": capture.guards,
        "committed_while_paused": os.path.exists(os.path.join(stream, MANIFEST)),
    }
    rank["failure"] = _finish(run, pause)
    gc.collect()
    rank["device_alive_after_write"] = sorted(name for name, w in saved_on_device.items() if not w.expired())
    reference += [update(run) for _ in range(tiny_run.STEPS_AFTER - 1)]
    result["equal_ranks"] = _gather(rank)
    if dist.get_rank() == 0:
        result["equal"] = same_step(sync, stream)
    result["stream_dir"] = stream
    return reference


def phase_held(run, d: str, result: dict) -> None:
    sync = save(run, os.path.join(d, "sync"), 8)
    stream, pause = _paused_stream_save(run, os.path.join(d, "stream"), 8)

    def change_device_params(run) -> None:  # no guard runs for this: it must not reach the write
        with torch.no_grad():
            for p in run.model.parameters():
                p.add_(1.0)

    update(run, change_device_params)
    failure = _finish(run, pause)
    result["held_ranks"] = _gather({"failure": failure, "committed": os.path.exists(os.path.join(stream, MANIFEST))})
    if dist.get_rank() == 0:
        result["held"] = same_step(sync, stream)


def phase_raced(run, d: str, result: dict) -> None:
    cases = {}
    for step, (name, change) in enumerate(
        (
            ("host_copy_add", lambda rank, p: p.add_(1.0)),
            ("host_copy_local_mul_on_rank1", lambda rank, p: rank == 1 and p.to_local().mul_(2.0)),
        ),
        start=20,
    ):
        path, pause = _paused_stream_save(run, os.path.join(d, "raced"), step, nth=1)
        with torch.no_grad():  # the model is offloaded: these are the host copies the writer reads
            for p in run.model.parameters():
                change(dist.get_rank(), p)
        failure = _finish(run, pause)
        cases[name] = _gather({"failure": failure, "committed": os.path.exists(os.path.join(path, MANIFEST))})
    result["raced"] = cases


def _measured_save(run, root: str, step: int, baseline: int, window: bool, **kw) -> int:
    """Peak RssAnon over `baseline` from the save to the end of its write and of the next update;
    `window`: the update comes once the write has ended (a rollout window longer than the write),
    else right after the save returns."""
    from slimckpt.observe.memory import RssSampler
    from slimckpt.save.modes.writer import writer_for
    from slimckpt.verl.manager_state import state_of

    with RssSampler(interval_s=0.002) as sampler:
        if root:  # else the update alone: what every row pays besides the save
            save(run, root, step, **kw)
        if window and root:
            writer_for(state_of(run.manager)).wait()
        update(run)
        writer_for(state_of(run.manager)).wait()
        dist.barrier()
    return max(0, sampler.result.peak - baseline)


def phase_memory(run, d: str, result: dict, repeats: int) -> None:
    """Sync first, pool last (its pool is held for the run): each mode's peaks over what the rank
    held before that mode's first save."""
    from slimckpt.observe.memory import rss_anon_bytes
    from slimckpt.save.modes.writer import state_bytes
    from slimckpt.save.state_dicts import build_state_dict

    save(run, os.path.join(d, "warm"), 30)  # the first save's one-time allocations out of the way
    update(run)
    rows, step = {}, 31
    small = {"bucket_mb": 1, "host_memory_budget_gb": 1.0}  # a sync save's bound well under the shard
    for mode, window, kw in (
        ("update_only", True, {}),
        ("sync", True, small),
        ("stream", True, {"async_save": "stream", **small}),
        ("stream_no_window", False, {"async_save": "stream", **small}),
        ("pool", True, {"async_save": "pool", **small}),
    ):
        gc.collect()
        baseline = rss_anon_bytes()
        rows[mode] = []
        for _ in range(repeats):
            root = os.path.join(d, mode) if mode != "update_only" else ""
            rows[mode].append(_measured_save(run, root, step, baseline, window, **kw))
            step += 1
    shard = state_bytes(build_state_dict(run.manager, model=True, optimizer=True))
    result["memory_ranks"] = _gather({"extra": rows, "shard_bytes": shard})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--hidden", type=int, default=256, help="model width (the memory phase's state size)")
    p.add_argument("--repeats", type=int, default=2, help="saves measured per mode")
    return p.parse_args(argv)


# a collective one rank never joins fails in 4 min, not gloo's 30 min; under the test's 480 s
PG_TIMEOUT_S = 240
BARRIER_AT_EXIT = False  # each rank closes the group as soon as it is done (rank 0 once its result is written)


def run(args: argparse.Namespace) -> None:
    install_device_double()
    base = tiny_run.tiny_args

    def sized():
        a = base()
        a.hidden, a.intermediate, a.vocab = args.hidden, 4 * args.hidden, 1024
        return a

    tiny_run.tiny_args, tiny_run.VOCAB = sized, 1024
    result: dict = {"world_size": dist.get_world_size()}
    torch.manual_seed(0)
    run = tiny_run.Run(seed=0, ckpt_config=_config())
    for _ in range(tiny_run.STEPS_BEFORE):
        update(run)
    seconds, t0 = {}, time.perf_counter()
    reference = phase_equal(run, args.dir, result)
    seconds["equal"], t0 = time.perf_counter() - t0, time.perf_counter()
    phase_held(run, args.dir, result)
    seconds["held"], t0 = time.perf_counter() - t0, time.perf_counter()
    phase_raced(run, args.dir, result)
    seconds["raced"], t0 = time.perf_counter() - t0, time.perf_counter()
    phase_memory(run, args.dir, result, args.repeats)
    seconds["memory"] = time.perf_counter() - t0
    result["seconds"] = seconds
    dist.barrier()
    torch.manual_seed(1234)
    resumed = tiny_run.Run(seed=1, ckpt_config=tiny_run.slim_config())
    resumed.manager.load_checkpoint(result.pop("stream_dir"))
    update_resumed = [update(resumed) for _ in range(tiny_run.STEPS_AFTER)]
    result.update(reference=reference, resumed=update_resumed)
    tiny_run.write_result(argparse.Namespace(dir=args.dir), "offload", result)
