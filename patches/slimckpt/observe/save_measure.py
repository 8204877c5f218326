"""Measuring a save of verl's FSDPCheckpointManager without changing it.

`measured_save` runs the save it is given unchanged and records, per rank: the seconds training
was blocked, the peak anonymous RSS above the level before the save, and the bytes this rank
wrote. Reports go outside the checkpoint (slimckpt.observe.save_reports), into
$SLIMCKPT_METRICS_FILE (one JSON line each) and the log.

Who calls it (both through slimckpt.verl.checkpoint_patches): the "measure" feature
(SLIMCKPT_MEASURE=1), whose patch wraps verl's own save and nothing else, so verl's retention,
tracker and load stay verl's; and a recipe's save (CheckpointOptions.measure). One save is measured once, whoever wraps it first.

An async save (the incremental tier's background write) is measured twice: its `save` report
covers the blocking part when the call returns; the `commit` report, written when the background
write commits, has the write's seconds, bytes and the peak RSS over the write window (the process's
RSS, training's own memory included: the write overlaps the next step) and the staging pool held
(pool mode), or what the mutation guards waited and copied (stream mode: training blocked after
the save returned).
"""

from __future__ import annotations

import contextvars
import json
import os
import time
from collections.abc import Callable
from typing import Any

from slimckpt import env_vars
from slimckpt.engine.checkpoint_dir import rank_files
from slimckpt.log import get_logger
from slimckpt.observe import save_reports
from slimckpt.observe.memory import RssSampler
from slimckpt.options.checkpoint_options import CheckpointOptions
from slimckpt.storage import for_path

log = get_logger("slimckpt.save")

METRICS_FILE_ENV = "SLIMCKPT_METRICS_FILE"
_MEASURING: contextvars.ContextVar[bool] = contextvars.ContextVar("slimckpt_measuring", default=False)


def _bytes_of(paths: list[str]) -> int:
    total = 0
    for path in paths:
        try:
            total += for_path(path).size(path)
        except OSError:
            pass
    return total


def bytes_written(local_path: str, rank: int) -> int:
    """This rank's files of the role dir, plus `huggingface/` on rank 0 (verl's hf_model, an export)."""
    files = [os.path.join(local_path, f) for f in rank_files(local_path, rank)]
    if rank == 0:
        hf_dir = os.path.join(local_path, "huggingface")
        store = for_path(hf_dir)
        files += [os.path.join(hf_dir, n) for n in store.list_dir(hf_dir)] if store.is_dir(hf_dir) else []
    return _bytes_of(files)


def record(report: dict[str, Any], local_path: str, rank: int, kind: str) -> None:
    """The report file, a line in $SLIMCKPT_METRICS_FILE, a log line; old steps' reports pruned."""
    save_reports.write_report(report, local_path, rank, kind)
    if rank == 0:
        save_reports.prune(save_reports.checkpoint_root(os.path.dirname(save_reports.norm_dir(local_path))))
    target = env_vars.path(METRICS_FILE_ENV)
    if target:
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        with open(target, "a") as f:
            f.write(json.dumps({**report, "kind": kind}) + "\n")
    mib = 2**20
    if kind == "save" and not report["committed"]:
        log.info(
            "save step %s rank %s: training blocked %.2f s, +%.1f MiB peak anonymous RSS; writing in the background",
            report["global_step"],
            rank,
            report["blocking_seconds"],
            report["peak_rss_extra_bytes"] / mib,
        )
    elif kind == "save":
        log.info(
            "save step %s rank %s: %.2f s, +%.1f MiB peak anonymous RSS, %.1f MiB written",
            report["global_step"],
            rank,
            report["seconds"],
            report["peak_rss_extra_bytes"] / mib,
            report["bytes_written"] / mib,
        )
    else:
        log.info(
            "step %s rank %s committed: background write %.2f s (%.2f s with the blocking part), +%.1f MiB "
            "peak anonymous RSS, %.1f MiB written, staging pool %.1f MiB, guards waited %.2f s and copied "
            "%.1f MiB",
            report["global_step"],
            rank,
            report["write_seconds"],
            report["seconds"],
            report["peak_rss_extra_bytes"] / mib,
            report["bytes_written"] / mib,
            report["staging_pool_bytes"] / mib,
            report.get("guard_blocked_seconds", 0.0),
            report.get("guard_copied_bytes", 0) / mib,
        )


def measured_save(
    state: Any, config: Any, rank: int, world_size: int, local_path: str, global_step: int, call: Callable[[], Any]
) -> Any:
    """Run `call` (the save) and record its reports; a save inside a measured one runs as is.
    `state`: the saved target's TargetState (its writer, whether the save failed); `config`: the
    caller's checkpoint config (CheckpointOptions for a recipe's)."""
    if _MEASURING.get() or local_path is None:
        return call()
    token = _MEASURING.set(True)
    start = time.perf_counter()
    try:
        with RssSampler() as sampler:
            result = call()
    finally:
        _MEASURING.reset(token)
    blocked = time.perf_counter() - start
    if state.save_failed:
        return result
    rank = int(rank)
    writer = state.writer
    in_background = writer is not None and writer.step == int(global_step)
    report = {
        "global_step": int(global_step),
        "rank": rank,
        "world_size": int(world_size),
        "role": os.path.basename(save_reports.norm_dir(local_path)),
        "recipe": (config.recipe if isinstance(config, CheckpointOptions) else None) or "verl-default",
        "save_contents": list((config.get("save_contents") if config else None) or []),
        "async": in_background,
        "committed": not in_background,
        "blocking_seconds": blocked,
        "seconds": None if in_background else blocked,
        "rss_anon_before_bytes": sampler.result.baseline,
        "peak_rss_anon_bytes": sampler.result.peak,
        "peak_rss_extra_bytes": sampler.result.extra,
        "bytes_written": None if in_background else bytes_written(local_path, rank),
        "time": time.time(),
    }
    record(report, local_path, rank, "save")
    if in_background:
        _measure_background_write(writer, report, local_path, rank)
    return result


def _measure_background_write(writer: Any, saved: dict[str, Any], local_path: str, rank: int) -> None:
    write_sampler = RssSampler().__enter__()
    write_start = time.perf_counter()

    capture = getattr(writer, "capture", None) if getattr(writer, "step", None) == saved["global_step"] else None

    def committed() -> None:
        write_sampler.__exit__(None, None, None)
        write_seconds = time.perf_counter() - write_start
        peak = max(saved["peak_rss_anon_bytes"], write_sampler.result.peak)
        record(
            {
                **{k: saved[k] for k in ("global_step", "rank", "world_size", "role", "recipe", "save_contents")},
                "async": True,
                "committed": True,
                "blocking_seconds": saved["blocking_seconds"],
                "write_seconds": write_seconds,
                "seconds": saved["blocking_seconds"] + write_seconds,
                "rss_anon_before_bytes": saved["rss_anon_before_bytes"],
                "peak_rss_anon_bytes": peak,
                "peak_rss_extra_bytes": max(0, peak - saved["rss_anon_before_bytes"]),
                "write_peak_rss_extra_bytes": max(0, write_sampler.result.peak - write_sampler.result.baseline),
                "staging_pool_bytes": 0
                if capture is not None
                else int(getattr(getattr(writer, "pool", None), "nbytes", 0)),
                # stream mode: what the guards (optimizer step, offload, ...) waited for the writer and copied
                "async_mode": writer.mode,
                "guard_blocked_seconds": capture.blocked_s if capture is not None else 0.0,
                "guard_copied_bytes": capture.copied_bytes if capture is not None else 0,
                "bytes_written": bytes_written(local_path, rank),
                "time": time.time(),
            },
            local_path,
            rank,
            "commit",
        )

    writer.after_commit(committed)
