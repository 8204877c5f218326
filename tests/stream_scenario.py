"""async_save=stream through verl's real FSDPCheckpointManager (FSDP2, gloo, CPU, 2 ranks, a tiny
tied-embedding Qwen2 with the gather-free HF export), run by tests/scenario_batch.py as "stream";
tests/test_stream_save.py asserts on D/stream/stream_result.json.

The writer is paused at a known read by slimckpt.save.stream_capture.READ_HOOK (no sleeps):

1. budget 1 GiB: save step 3 (a sync save of the same step first, as the reference), pause the
   writer at its second read, train STEPS_AFTER steps (the first optimizer step's guard copies
   what is unread), then let it finish. A fresh run loads the stream step and trains the same
   steps: the losses must be bitwise equal (with a resume).
2. budget 0: a sync and a stream save of step 6; the writer is paused, the next optimizer step's
   guard cannot copy and must wait: the pause is released once it is waiting. The committed step
   equals the sync save bit for bit (without a resume).
3. a parameter changed in place (no guard runs) while the writer is paused before it: the step
   fails in one line naming the tensor and is never committed.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

import torch
import torch.distributed as dist

import resume_scenarios as rs

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


def _same_step(sync_dir: str, stream_dir: str) -> dict:
    """Rank 0: the two committed steps compared file by file and tensor by tensor."""
    a, b = _digests(sync_dir), _digests(stream_dir)
    return {
        "files": sorted(a), "differing_files": sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)),
        "tensor_diffs": rs._tensors_equal(_dcp_state(sync_dir), _dcp_state(stream_dir))[:10],
    }


def _config(**kw):
    return rs.slim_config(export_hf=True, export_dtype="auto", max_shard_size="20KB", **kw)


def _save(run, root: str, step: int, **kw) -> tuple[str, float]:
    path = os.path.join(root, f"global_step_{step}", "actor")
    run.manager.checkpoint_config = _config(**kw)
    t0 = time.perf_counter()
    run.manager.save_checkpoint(path, global_step=step)
    return path, time.perf_counter() - t0


def scenario(args) -> None:
    from slimckpt.save import stream_capture
    from slimckpt.save.resume_async import writer_for

    rank = dist.get_rank()
    sync_root, stream_root = os.path.join(args.dir, "sync"), os.path.join(args.dir, "stream")
    run = rs.Run(seed=0, ckpt_config=_config())
    writer = writer_for(run.manager)
    for _ in range(rs.STEPS_BEFORE):
        run.step()
    result: dict = {}

    # 1. budget ample: the optimizer step's guard copies what the paused writer has not read
    sync3, _ = _save(run, sync_root, rs.SAVE_STEP)
    pause = PauseAt(2)
    stream_capture.READ_HOOK = pause
    try:
        stream3, blocking = _save(run, stream_root, rs.SAVE_STEP, async_save="stream", host_memory_budget_gb=1.0)
        assert pause.reached.wait(timeout=120), "the stream writer never started reading"
        capture = writer.capture
        reference = [run.step() for _ in range(rs.STEPS_AFTER)]
        result.update(blocking_s=blocking, committed_while_paused=os.path.exists(os.path.join(stream3, MANIFEST)),
                      guard_copied_bytes=capture.copied_bytes, captured_bytes=capture.nbytes,
                      guard_blocked_s=capture.blocked_s, guards=capture.guards)
        pause.release()
        writer.wait()
    finally:
        stream_capture.READ_HOOK = None
    dist.barrier()
    if rank == 0:
        result["step3"] = _same_step(sync3, stream3)

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
                time.sleep(0.005)
            pause.release()

        releaser = threading.Thread(target=release_once_waiting, daemon=True)
        releaser.start()
        run.step()  # its optimizer step waits for the writer
        releaser.join()
        writer.wait()
        result.update(zero_budget_copied_bytes=capture.copied_bytes, zero_budget_guards=capture.guards,
                      zero_budget_blocked_s=capture.blocked_s)
    finally:
        stream_capture.READ_HOOK = None
    dist.barrier()
    if rank == 0:
        result["step6"] = _same_step(sync6, stream6)

    # 3. an unguarded in-place change of the tensor the paused writer is about to read
    pause = PauseAt(3)
    stream_capture.READ_HOOK = pause
    try:
        stream7, _ = _save(run, stream_root, 7, async_save="stream", host_memory_budget_gb=1.0)
        assert pause.reached.wait(timeout=120)
        victim = next(s for s in writer.capture._sources.values() if s.name == pause.name)
        with torch.no_grad():
            victim.live.add_(1.0)
        pause.release()
        try:
            writer.wait()
            failure = None
        except RuntimeError as exc:
            failure = str(exc)
    finally:
        stream_capture.READ_HOOK = None
    dist.barrier()
    result.update(mutated=pause.name, mutation_failure=failure,
                  mutated_step_committed=os.path.exists(os.path.join(stream7, MANIFEST)))

    # with a resume: a fresh run loads the stream step 3 and trains the steps the first run did
    dist.barrier()
    torch.manual_seed(1234)
    resumed = rs.Run(seed=1, ckpt_config=rs.slim_config())
    resumed.manager.load_checkpoint(stream3)
    result.update(reference=reference, resumed=[resumed.step() for _ in range(rs.STEPS_AFTER)])
    all_results: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_results, {k: result.get(k) for k in ("mutated", "mutation_failure",
                                                                     "mutated_step_committed", "guard_copied_bytes",
                                                                     "zero_budget_copied_bytes")})
    result["ranks"] = all_results
    rs.write_result(args, "stream", result)
