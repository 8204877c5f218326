"""async_save=stream through verl's real FSDPCheckpointManager (FSDP2, gloo, CPU, 2 ranks, a tiny
tied-embedding Qwen2 with the gather-free HF export), run by slimckpt_testing/scenarios/batch.py as "stream";
tests/save/test_stream_capture.py asserts on D/stream/stream_result.json.

The writer is paused at a known read by slimckpt.save.modes.stream_capture.READ_HOOK (no sleeps):

1. budget 1 GiB: save step 3 (a sync save of the same step first, as the reference), pause the
   writer at its second read, train STEPS_AFTER steps (the first optimizer step's guard copies
   what is unread), then let it finish. A fresh run loads the stream step and trains the same
   steps: the losses must be bitwise equal (with a resume).
2. budget 0: a sync and a stream save of step 6; the writer is paused, the next optimizer step's
   guard cannot copy and must wait: the pause is released once it is waiting. The committed step
   equals the sync save bit for bit (without a resume).
3. a parameter changed in place (no guard runs) while the writer is paused before it: the step
   fails in one line naming the tensor and is never committed.

`raced` (FSDP2 and FSDP1, a Llama): right after save_checkpoint returns, with the writer paused at
its first read, the weights are changed the ways user code changes them (the cases of RACES); the
writer then goes on. FSDP2 reads the live shards: every such step fails on every rank, is never
committed, and the trainer's tracker stays on the last committed step. FSDP1 writes the sharded
state dict FSDP1 builds as new tensors: the step commits and equals a sync save of the same step
file for file. The control: optimizer.load_state_dict puts new tensors in the optimizer (the saved
ones are left as they were) and the next step runs the guard: commits, equal to the sync save.
"""

from __future__ import annotations

import copy
import hashlib
import os
import threading
import time

import torch
import torch.distributed as dist

import slimckpt_testing.scenarios.tiny_run as tiny_run

# lazy imports: slimckpt's stream capture and torch's internals load inside the scenario, after the batch set the module settings they read

MANIFEST = "slimckpt_resume.json"


class PauseAt:
    """READ_HOOK: the n-th read of this rank's writer waits until `release` (the reads before it
    and after it run free)."""

    def __init__(self, nth: int) -> None:
        self.nth, self.count, self.name = nth, 0, None
        self.reached, self.go = threading.Event(), threading.Event()

    def __call__(self, name: str) -> None:
        self.count += 1
        if self.count == self.nth:
            self.name = name
            self.reached.set()
            # the scenario releases the writer after seconds of steps; 120 s is a hang, under the 240 s group
            if not self.go.wait(timeout=120):
                raise RuntimeError("stream scenario: the paused writer was never released")

    def release(self) -> None:
        self.go.set()


def _digests(root: str) -> dict[str, str]:
    """sha256 of every data file of a committed step (the DCP rank files and the export), by
    relative path; .metadata and the manifest hold per-save ids and timings, compared apart."""
    out = {}
    for sub in ("dcp", "huggingface"):
        base = os.path.join(root, sub)
        for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            if name.endswith(".distcp") or name.endswith(".safetensors"):
                with open(os.path.join(base, name), "rb") as f:
                    out[f"{sub}/{name}"] = hashlib.sha256(f.read()).hexdigest()
    return out


def _dcp_state(root: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(root, "..", "..", f"full_{os.path.basename(os.path.dirname(root))}.pt")
    dcp_to_torch_save(os.path.join(root, "dcp"), out)
    return torch.load(out, weights_only=False)


def same_step(sync_dir: str, stream_dir: str) -> dict:
    """Rank 0: the two committed steps compared file by file and tensor by tensor."""
    a, b = _digests(sync_dir), _digests(stream_dir)
    return {
        "files": sorted(a),
        "differing_files": sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)),
        "tensor_diffs": tiny_run.tensors_equal(_dcp_state(sync_dir), _dcp_state(stream_dir))[:10],
    }


def _config(**kw):
    return tiny_run.slim_config(**{"export_hf": True, "export_dtype": "auto", "max_shard_size": "20KB", **kw})


def _save(run, root: str, step: int, **kw) -> tuple[str, float]:
    path = os.path.join(root, f"global_step_{step}", "actor")
    run.manager.checkpoint_config = _config(**kw)
    t0 = time.perf_counter()
    run.manager.save_checkpoint(path, global_step=step)
    return path, time.perf_counter() - t0


def _raced_save(run, root: str, step: int, nth: int, change, **kw) -> tuple[str, str | None, str | None]:
    """A stream save whose writer is paused at its `nth` read while `change(pause)` runs; then
    the write ends. (path, the source it paused before, the write's failure or None)."""
    from slimckpt.save.modes import stream_capture
    from slimckpt.save.modes.writer import writer_for
    from slimckpt.verl.manager_state import state_of

    pause = PauseAt(nth)
    stream_capture.READ_HOOK = pause
    failure = None
    try:
        path, _ = _save(run, root, step, async_save="stream", **kw)
        # the writer reads within milliseconds of the save; 120 s is a hang, under the 240 s group timeout
        assert pause.reached.wait(timeout=120), "the stream writer never started reading"
        change(pause)
        pause.release()
        try:
            writer_for(state_of(run.manager)).wait()
        except RuntimeError as exc:
            failure = str(exc)
    finally:
        stream_capture.READ_HOOK = None
    dist.barrier()
    return path, pause.name, failure


def scenario(args) -> None:
    from slimckpt.save.modes import stream_capture
    from slimckpt.save.modes.writer import writer_for
    from slimckpt.verl.manager_state import state_of

    rank = dist.get_rank()
    sync_root, stream_root = os.path.join(args.dir, "sync"), os.path.join(args.dir, "stream")
    run = tiny_run.Run(seed=0, ckpt_config=_config())
    writer = writer_for(state_of(run.manager))
    for _ in range(tiny_run.STEPS_BEFORE):
        run.step()
    result: dict = {}

    # 1. budget ample: the optimizer step's guard copies what the paused writer has not read
    sync3, _ = _save(run, sync_root, tiny_run.SAVE_STEP)
    pause = PauseAt(2)
    stream_capture.READ_HOOK = pause
    try:
        stream3, blocking = _save(run, stream_root, tiny_run.SAVE_STEP, async_save="stream", host_memory_budget_gb=1.0)
        # the writer reads within milliseconds of the save; 120 s is a hang, under the 240 s group timeout
        assert pause.reached.wait(timeout=120), "the stream writer never started reading"
        capture = writer.capture
        reference = [run.step() for _ in range(tiny_run.STEPS_AFTER)]
        result.update(
            blocking_s=blocking,
            committed_while_paused=os.path.exists(os.path.join(stream3, MANIFEST)),
            guard_copied_bytes=capture.copied_bytes,
            captured_bytes=capture.nbytes,
            guard_blocked_s=capture.blocked_s,
            guards=capture.guards,
        )
        pause.release()
        writer.wait()
    finally:
        stream_capture.READ_HOOK = None
    dist.barrier()
    if rank == 0:
        result["step3"] = same_step(sync3, stream3)

    # 2. budget 0: the guard copies nothing and waits for the paused writer
    sync6, _ = _save(run, sync_root, 6)
    pause = PauseAt(2)
    stream_capture.READ_HOOK = pause
    try:
        stream6, _ = _save(run, stream_root, 6, async_save="stream", host_memory_budget_gb=0.0)
        assert pause.reached.wait(timeout=120)
        capture = writer.capture

        def release_once_waiting() -> None:
            while capture.guards == 0 and not capture.closed:
                # a 5 ms poll: the writer is released within milliseconds of the guard starting to wait
                time.sleep(0.005)
            pause.release()

        releaser = threading.Thread(target=release_once_waiting, daemon=True)
        releaser.start()
        run.step()  # its optimizer step waits for the writer
        releaser.join()
        writer.wait()
        result.update(
            zero_budget_copied_bytes=capture.copied_bytes,
            zero_budget_guards=capture.guards,
            zero_budget_blocked_s=capture.blocked_s,
        )
    finally:
        stream_capture.READ_HOOK = None
    dist.barrier()
    if rank == 0:
        result["step6"] = same_step(sync6, stream6)

    # 3. an unguarded in-place change of the tensor the paused writer is about to read
    def change_paused_source(pause: PauseAt) -> None:
        victim = next(s for s in writer.capture._sources.values() if s.name == pause.name)
        with torch.no_grad():
            victim.live.add_(1.0)

    stream7, mutated, failure = _raced_save(run, stream_root, 7, 3, change_paused_source, host_memory_budget_gb=1.0)
    result.update(
        mutated=mutated,
        mutation_failure=failure,
        mutated_step_committed=os.path.exists(os.path.join(stream7, MANIFEST)),
    )

    # with a resume: a fresh run loads the stream step 3 and trains the steps the first run did
    dist.barrier()
    torch.manual_seed(1234)
    resumed = tiny_run.Run(seed=1, ckpt_config=tiny_run.slim_config())
    resumed.manager.load_checkpoint(stream3)
    result.update(reference=reference, resumed=[resumed.step() for _ in range(tiny_run.STEPS_AFTER)])
    all_results: list = [None] * dist.get_world_size()
    dist.all_gather_object(
        all_results,
        {
            k: result.get(k)
            for k in (
                "mutated",
                "mutation_failure",
                "mutated_step_committed",
                "guard_copied_bytes",
                "zero_budget_copied_bytes",
            )
        },
    )
    result["ranks"] = all_results
    tiny_run.write_result(args, "stream", result)


def _add_then_step(run, rank: int) -> None:
    """User code as a training loop writes it: every parameter changed in place, then the optimizer step."""
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_(1.0)
    run.step()


def _step_without_hook(run, rank: int) -> None:
    from slimckpt.save.modes.writer import writer_for
    from slimckpt.verl.manager_state import state_of

    writer_for(state_of(run.manager))._remove_hook()  # an optimizer step that runs no slimckpt guard
    run.step()


def _load_state_dict(run, rank: int) -> None:
    state = {k: v.detach() + 0.5 for k, v in run.model.state_dict().items()}
    if tiny_run.FSDP_VERSION == 2:
        run.model.load_state_dict(state)
    else:  # FSDP1's own state_dict()/load_state_dict() are full (unsharded) dicts
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

        sharded = StateDictOptions(full_state_dict=False)
        set_model_state_dict(
            run.model,
            {k: v + 0.5 for k, v in get_model_state_dict(run.model, options=sharded).items()},
            options=sharded,
        )


def _local_add_on_rank1(run, rank: int) -> None:
    """An in-place change of the local shard (`to_local()`), on one rank only."""
    if rank == 1:
        with torch.no_grad():
            for p in run.model.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).mul_(2.0)


def _optimizer_reload_then_step(run, rank: int) -> None:
    run.optimizer.load_state_dict(copy.deepcopy(run.optimizer.state_dict()))
    run.step()


# name -> (export_hf, what the user code does, whether the FSDP2 step must fail)
RACES = {
    "add_then_step": (True, _add_then_step, True),
    "add_then_step_no_export": (False, _add_then_step, True),
    "step_without_hook": (True, _step_without_hook, True),
    "load_state_dict": (True, _load_state_dict, True),
    "local_add_on_rank1": (False, _local_add_on_rank1, True),
    "optimizer_reload_then_step": (True, _optimizer_reload_then_step, False),
}


def _commit_tracker(watcher, root: str, step: int) -> str | None:
    """Rank 0: what the trainer's process does after a save (data.pt, then the tracker once the
    step is committed); the error it raises for a failed step."""
    with open(os.path.join(root, f"global_step_{step}", "data.pt"), "wb"):
        pass
    watcher.after_save(step, ["actor"])
    try:
        # the write has ended: the watcher's next 0.2 s poll settles it; 60 s is a hang
        watcher.wait(timeout=60)
    except RuntimeError as exc:
        return str(exc)
    return None


def scenario_raced(args) -> None:
    from slimckpt.layout.resume_manifest import read_tracker
    from slimckpt.save.driver.tracker import CommitWatcher

    rank = dist.get_rank()
    root, sync_root = os.path.join(args.dir, "ckpt"), os.path.join(args.dir, "sync")
    run = tiny_run.Run(seed=0, ckpt_config=_config())
    watcher = CommitWatcher(root) if rank == 0 else None
    for _ in range(tiny_run.STEPS_BEFORE):
        run.step()
    _save(run, root, 1)
    if rank == 0:
        assert _commit_tracker(watcher, root, 1) is None and read_tracker(root) == 1
    dist.barrier()
    result: dict = {"fsdp": tiny_run.FSDP_VERSION, "cases": {}}
    for i, (name, (export, change, must_fail)) in enumerate(RACES.items()):
        step = 10 + i
        # the reference of a step that must commit: a sync save of the same state
        sync_path = (
            None if must_fail and tiny_run.FSDP_VERSION == 2 else _save(run, sync_root, step, export_hf=export)[0]
        )
        path, _, failure = _raced_save(
            run, root, step, 1, lambda _pause: change(run, rank), host_memory_budget_gb=1.0, export_hf=export
        )
        case = {"failure": failure, "committed": os.path.exists(os.path.join(path, MANIFEST))}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, case)
        case = {"ranks": gathered, "export_hf": export, "must_fail": must_fail}
        if rank == 0:
            case["tracker_error"] = _commit_tracker(watcher, root, step)
            case["tracker"] = read_tracker(root)
            if sync_path is not None and all(r["committed"] for r in gathered):
                case["same_as_sync"] = same_step(sync_path, path)
        result["cases"][name] = case
        dist.barrier()
        run.manager.checkpoint_config = _config()
    tiny_run.write_result(args, f"raced_fsdp{tiny_run.FSDP_VERSION}", result)
