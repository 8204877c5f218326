"""Resume state of the incremental tier: model, optimizer and extra state (lr scheduler, RNG) of a
verl FSDPCheckpointManager, written with bounded host memory, reshardable, committed atomically.

Layout of a role directory (`<root>/global_step_N/actor`):

    dcp/                       torch.distributed.checkpoint (DCP): `__{rank}_0.distcp` per rank and
                               `.metadata` (global shapes and where each chunk lives). Model and
                               optimizer are keyed by parameter name, not by rank, so a load at any
                               world size reads the rows it needs (resharding).
    slimckpt_extra_world_size_{W}_rank_{r}.pt   lr scheduler + RNG of rank r, as verl's extra_state
    huggingface/, fsdp_config.json              written by verl's own save code, unchanged
    slimckpt_resume.json       the manifest, written LAST (see resume_manifest): no manifest, no load

Flow (plan -> stage -> write -> commit): DCP plans which rank writes which chunk; sync mode streams
tensor by tensor to disk (host memory: write_threads x (bucket_mb + one tensor) on GPU, one tensor
on CPU); async pool mode stages the rank's tensors into a reused host pool (within
host_memory_budget_gb) and writes on a background thread (resume_async); async stream mode writes
on that thread from the live shards, guarded until read (stream_capture). Then every rank reports
its files, rank 0 writes the manifest and only then applies retention, then tells every rank the
outcome: no rank's save (or background write) ends before its step is committed or has failed.

Everything else verl's save does (huggingface/ config + tokenizer + generation config on rank 0,
fsdp_config.json, LoRA meta, `hf_model` if asked) is done by calling verl's own save with the shard
contents removed, so it stays exactly verl's. With `export_hf`, the weights of huggingface/ are
written without a gather (hf_direct_export, in place of verl's `hf_model`): planned at save time,
written after the shards (from the staged copy in async mode) and before the commit.

verl's `save_lora_only` (a peft actor): as verl's own save keeps only the keys holding "lora_" or
".adapter_", the step's model state is the adapter's parameters (the optimizer state is theirs
anyway: the base is frozen), the manifest says `lora_only`, the export is `lora_adapter/` alone,
and a load sets those parameters and keeps the base weights the model was built with, i.e.
actor_rollout_ref.model.path's (what the user needs at load: the same base model).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..log import get_logger
from ..read import checkpoint_dir
from ..read.checkpoint_dir import DCP_DIR
from ..read.pickle_policy import trusting
from ..read.safe_load import load_torch_file
from ..read.step_pickles import dcp_refusals, native_refusals
from .pickle_gate import refuse_together
from . import hf_direct_export, host_budget, rng_reshard
from ..format.dropped_optimizer import optimizer_dropped, resume_line
from ..format.resume_manifest import (
    FAILED_PREFIX,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    UncommittedCheckpoint,
    describe_files,
    has_manifest,
    remove_manifest,
    role_damage,
    unlisted_files,
    write_manifest,
)

log = get_logger("slimckpt.resume")

EXTRA_PREFIX = "slimckpt_extra_"
EXTRA_NAME = EXTRA_PREFIX + "world_size_{world}_rank_{rank}.pt"
SHARD_CONTENTS = ("model", "optimizer", "extra")


# --------------------------------------------------------------------------- format detection


def is_resume_state(local_path: str | None) -> bool:
    """True when `local_path` was written by this tier (committed or not)."""
    if not local_path:
        return False
    return has_manifest(local_path) or os.path.isdir(os.path.join(local_path, DCP_DIR))


def wants_incremental(config: Any) -> bool:
    from ..verl.checkpoint_config import SlimCheckpointConfig

    return isinstance(config, SlimCheckpointConfig) and bool(config.incremental_save)


# --------------------------------------------------------------------------- process group


def checkpoint_group(manager) -> dist.ProcessGroup:
    """A gloo group of the manager's ranks for DCP's coordination and our commit: object
    collectives stay off the accelerator, and a background write never shares a group (and so a
    collective order) with training. One per manager, so actor and critic never interleave."""
    group = getattr(manager, "_slimckpt_group", None)
    if group is None:
        from ..write import peers

        # the job's own timeout (torch would give a gloo group 30 minutes), and a heartbeat so that a
        # collective that loses a rank can name it
        group = dist.new_group(backend="gloo", timeout=peers.default_group_timeout())
        peers.process_heartbeat()
        manager._slimckpt_group = group
    return group


# --------------------------------------------------------------------------- state dicts


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # sharded, on the tensors' own device: DCP copies each to host only while writing it
    return StateDictOptions(full_state_dict=False, cpu_offload=False)


def _load_options(partial: bool):
    """Load options; `partial` (a LoRA-only step): the base weights the step does not hold are kept."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, cpu_offload=False, strict=not partial)


def build_state_dict(manager, model: bool, optimizer: bool, optimizer_state: bool | None = None) -> dict[str, Any]:
    """{"model": ..., "optim": ...} keyed by parameter name; FSDP2 gives views of the live shards
    (no copy). FSDP1 builds its sharded state dict on the device. The optimizer's part is taken
    as it is (optim_capture: a save before the first step changes nothing); for a load,
    `optimizer_state` says whether the step holds per-parameter optimizer state to read into."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from . import optim_capture

    state: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model:
            state["model"] = get_model_state_dict(manager.model, options=_options())
    if optimizer and optimizer_state is None:
        state["optim"] = optim_capture.capture(manager.model, manager.optimizer, _options())
    elif optimizer:
        state["optim"] = optim_capture.load_template(manager.model, manager.optimizer, _options(), optimizer_state)
    return state


def _view_key(t: Any) -> tuple | None:
    local = t.to_local() if hasattr(t, "to_local") else t
    if not isinstance(local, torch.Tensor) or local.device.type == "meta" or local.numel() == 0:
        return None
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), local.stride(),
            local.dtype)


def split_aliases(model_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Drop keys that view the same memory as an earlier key (tied embeddings: lm_head.weight is
    embed_tokens.weight). DCP would write such a tensor once per name; it is written once and the
    alias is recorded in the manifest."""
    first: dict[tuple, str] = {}
    kept: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for name, value in model_state.items():
        key = _view_key(value)
        if key is not None and key in first:
            aliases[name] = first[key]
            continue
        if key is not None:
            first[key] = name
        kept[name] = value
    return kept, aliases


def storage_writer(path: str, config: Any):
    """DCP's FileSystemWriter, holding one tensor per thread in host memory (write.dcp_file_writer),
    with a filesystem that checksums each file as it is written."""
    from ..write.dcp_file_writer import BoundedFileSystemWriter
    from ..write.hashing_fs import HashingFileSystem

    writer = BoundedFileSystemWriter(
        path,
        single_file_per_rank=True,
        sync_files=True,
        thread_count=int(getattr(config, "write_threads", 1)),
        per_thread_copy_ahead=int(getattr(config, "bucket_mb", 64)) * 2**20,
        overwrite=True,
    )
    writer.fs = HashingFileSystem()
    return writer


def written_checksums(writer: Any, local_path: str) -> dict[str, str]:
    """{path relative to the role dir: checksum} of the files a storage_writer wrote."""
    sums = getattr(getattr(writer, "fs", None), "checksums", {})
    return {os.path.relpath(p, local_path).replace(os.sep, "/"): c for p, c in sums.items()}


@contextlib.contextmanager
def load_contents(manager, contents: list[str]) -> Iterator[None]:
    """Run a load with only `contents` (verl's should_load_* read this list)."""
    loaded = manager.checkpoint_load_contents
    manager.checkpoint_load_contents = list(contents)
    try:
        yield
    finally:
        manager.checkpoint_load_contents = loaded


@contextlib.contextmanager
def save_contents(manager, contents: list[str]) -> Iterator[None]:
    """Run verl's save with only `contents` (its should_save_* read this list)."""
    saved = manager.checkpoint_save_contents
    manager.checkpoint_save_contents = list(contents)
    try:
        yield
    finally:
        manager.checkpoint_save_contents = saved


# --------------------------------------------------------------------------- save_lora_only

LORA_ONLY_KEY = "lora_only"  # manifest.extra: the step holds the adapter's parameters, not the base's


def is_lora_key(name: str) -> bool:
    """verl 0.9.1's test for what save_lora_only keeps (FSDPCheckpointManager.save_checkpoint)."""
    return "lora_" in name or ".adapter_" in name


def lora_only_state(model_state: dict[str, Any]) -> dict[str, Any]:
    """The trainable LoRA parameters of a sharded model state dict, as verl's save_lora_only keeps
    them; verl's error when there are none."""
    kept = {k: v for k, v in model_state.items() if is_lora_key(k)}
    if not kept:
        raise ValueError(f"save_lora_only is True and the model has a peft_config, but no LoRA/adapter parameters "
                         f"were found in the state dict. Total params checked: {len(model_state)}.")
    return kept


def _note_lora_only(manager, model_state: dict[str, Any], total: int) -> None:
    if manager.rank != 0 or getattr(manager, "_slimckpt_lora_only_noted", False):
        return
    manager._slimckpt_lora_only_noted = True
    from .resume_async import state_bytes

    log.info("save_lora_only: the resume state holds the %d LoRA parameters of %d (%.1f MiB on rank 0) and their "
             "optimizer state; a resume takes the base weights from actor_rollout_ref.model.path, as verl's does",
             len(model_state), total, state_bytes(model_state) / 2**20)


# --------------------------------------------------------------------------- files of a rank


def _extra_path(local_path: str, world: int, rank: int) -> str:
    return os.path.join(local_path, EXTRA_NAME.format(world=world, rank=rank))


def save_extra(manager, local_path: str) -> str:
    """lr scheduler + RNG of this rank, as verl's extra_state (fsynced, renamed into place)."""
    path = _extra_path(local_path, manager.world_size, manager.rank)
    state = {
        "lr_scheduler": manager.lr_scheduler.state_dict() if manager.lr_scheduler is not None else None,
        "rng": manager.get_rng_state(),
    }
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def rank_files(local_path: str, rank: int, world: int) -> list[str]:
    """Files of the resume state this rank wrote, relative to `local_path`."""
    written = checkpoint_dir.rank_files(local_path, rank)
    out = [f for f in written if f.startswith(f"{DCP_DIR}/")]
    if rank == 0 and os.path.exists(os.path.join(local_path, DCP_DIR, ".metadata")):
        out.append(f"{DCP_DIR}/.metadata")
    extra = EXTRA_NAME.format(world=world, rank=rank)
    if extra in written:
        out.append(extra)
    if rank == 0 and os.path.exists(os.path.join(local_path, "fsdp_config.json")):
        out.append("fsdp_config.json")
    if rank == 0:  # huggingface/: verl's configs and tokenizer, the export's weights (every rank wrote rows)
        out += hf_direct_export.export_files(local_path)
    return out


def _clear_stale(local_path: str) -> None:
    """Before (re)writing a step: uncommit it first, then drop what an earlier attempt left."""
    remove_manifest(local_path)
    shutil.rmtree(os.path.join(local_path, DCP_DIR), ignore_errors=True)
    for name in os.listdir(local_path):
        if name.startswith(EXTRA_PREFIX) or name.startswith(FAILED_PREFIX):
            os.remove(os.path.join(local_path, name))


# --------------------------------------------------------------------------- retention


def make_room(manager, max_keep: int | None) -> list[str]:
    """Where verl's ensure_checkpoint_capacity deletes before a save: nothing is deleted until the
    new step is committed (slimckpt.save.retention); returns the steps whose optimizer state goes
    before the new step is written (keep_optimizer_last)."""
    from . import retention

    return retention.optimizer_drops(manager, max_keep)


def _drop_first(manager, drops: list[str]):
    """The optimizer drops of make_room, run where the save writes (foreground, or the background
    writer before its shards: an async save's blocking time stays the same)."""
    if not drops:
        return None
    from . import retention

    return functools.partial(retention.drop_before_save, drops, getattr(manager.checkpoint_config,
                                                                        "keep_optimizer_last", None))


def register_committed(manager, local_path: str, max_keep: int | None) -> None:
    """verl's register_checkpoint, run only after the commit: never deletes the tracker's step or a
    locked one (slimckpt.save.retention)."""
    from . import retention

    retention.after_save(manager, local_path, max_keep)


# --------------------------------------------------------------------------- commit


class CommitFailed(RuntimeError):
    """The commit of a step failed on some rank; every rank raises it with the same line."""


def _shared_outcome(group: dist.ProcessGroup, failure: tuple | None) -> None:
    """Rank 0 tells every rank how the commit ended; each raises the same CommitFailed if it failed
    (caused by the same OSError where one was the cause, so every rank's save error names the same
    fix). Until this returns no rank's save (or background write) is over, so a load right after
    it on any rank finds the manifest rank 0 wrote."""
    box = [failure]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if box[0] is not None:
        line, os_error = box[0]
        raise CommitFailed(line) from (OSError(*os_error) if os_error else None)


def _failure(where: str, exc: BaseException) -> tuple[str, tuple | None]:
    """(one line, the errno, strerror and filename of its OSError if it is one) of a commit's failure."""
    first = (str(exc).strip().splitlines() or [""])[0]
    os_error = (exc.errno, exc.strerror, exc.filename) if isinstance(exc, OSError) and exc.errno else None
    return f"{where}: {type(exc).__name__}: {first}", os_error


def commit(manager, local_path: str, global_step: int, contents: list[str], config: Any,
           group: dist.ProcessGroup, max_keep: int | None, timings: dict[str, float],
           aliases: dict[str, str] | None = None, known: dict[str, str] | None = None,
           lora_only: bool = False) -> None:
    """Every rank lists and checksums its files; rank 0 adds every other file of the dir (verl's
    huggingface/ ...), writes the manifest, then applies retention, and every rank learns the
    outcome: a failure on any rank is raised on all of them, as the same CommitFailed. Collective
    over `group`; the caller has finished all writes."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    t0 = time.perf_counter()
    mine, failure = [], None
    try:  # DCP's files were hashed while written (`known`); the rest (extra state, the export) is read back
        mine = [e.to_json() for e in describe_files(local_path, rank_files(local_path, rank, world), known=known)]
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, raised on every rank below
        failure = _failure(f"rank {rank}", exc)
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object((mine, failure), gathered, dst=dist.get_global_rank(group, 0), group=group)
    if rank != 0:
        _shared_outcome(group, None)
        return
    reported = gathered or []
    failure = next((f for _, f in reported if f is not None), None)
    if failure is None:
        try:
            _commit_on_rank0(manager, local_path, global_step, contents, [e for part, _ in reported for e in part],
                             world, max_keep, timings, t0, aliases, lora_only)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            log.debug("commit of step %s at %s failed on rank 0", global_step, local_path, exc_info=True)
            failure = _failure("rank 0", exc)
    if failure is not None:
        failure = (f"slimckpt: step {global_step} at {local_path} was not committed: {failure[0]}", failure[1])
    _shared_outcome(group, failure)


def _commit_on_rank0(manager, local_path: str, global_step: int, contents: list[str], reported: list[dict],
                     world: int, max_keep: int | None, timings: dict[str, float], t0: float,
                     aliases: dict[str, str] | None, lora_only: bool) -> None:
    files = [FileEntry.from_json(e) for e in reported]
    files += describe_files(local_path, unlisted_files(local_path, [f.path for f in files]))
    timings["checksum"] = time.perf_counter() - t0  # rank 0's, gather included
    fsdp_version = None
    with contextlib.suppress(Exception):
        from verl.utils.fsdp_utils import fsdp_version as _fsdp_version

        fsdp_version = int(_fsdp_version(manager.model))
    write_manifest(local_path, Manifest(
        global_step=int(global_step), world_size=world, contents=list(contents), files=files,
        fsdp_version=fsdp_version,
        extra={"timings_s": timings, "bytes": sum(f.bytes for f in files), "aliases": dict(aliases or {}),
               **({LORA_ONLY_KEY: True} if lora_only else {})},
    ))
    register_committed(manager, local_path, max_keep)
    log.info("committed step %s at %s: %d files, %.1f MiB (%s)", global_step, local_path, len(files),
             sum(f.bytes for f in files) / 2**20, ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()))


def _after_shards(manager, local_path: str, config: Any, model_state: dict[str, Any] | None = None,
                  export: Any = None, group: dist.ProcessGroup | None = None,
                  timings: dict[str, float] | None = None, reads: Any = None) -> None:
    """The gather-free HF export (hf_direct_export: every rank writes its own rows of the final
    safetensors files at their planned offsets). It runs after the shards are on disk and before
    the manifest, whose file list then includes huggingface/: a committed step always has its
    whole export, a half-written one is never committed."""
    if export is None or not getattr(config, "export_hf", False):
        return
    start = time.perf_counter()
    hf_direct_export.write_export(manager, export, local_path, model_state or {}, config, group, stream_reads=reads)
    if timings is not None:
        timings["export_hf"] = time.perf_counter() - start


# --------------------------------------------------------------------------- save


def _note_fsdp1_copy(manager, state: dict[str, Any]) -> None:
    """Say once what FSDP1 costs here: its sharded state dicts are new tensors (model rows
    re-chunked, optimizer state cut out of the flat parameters), all alive during the write."""
    if getattr(manager, "_slimckpt_fsdp1_noted", False):
        return
    manager._slimckpt_fsdp1_noted = True
    with contextlib.suppress(Exception):
        from verl.utils.fsdp_utils import fsdp_version

        if fsdp_version(manager.model) == 1 and manager.rank == 0:
            from .resume_async import state_bytes

            log.warning("FSDP1: the reshardable state dict is a %.1f MiB copy of this rank's shards on %s while "
                        "it is written (strategy=fsdp2 saves without a copy)", state_bytes(state) / 2**20,
                        next(iter(manager.model.parameters())).device.type)


def _lap(timings: dict[str, float]):
    """timings[name] = seconds since the previous lap (the save's phases, kept in the manifest)."""
    last = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        timings[name] = now - last[0]
        last[0] = now

    return lap


def save_resume_state(original, manager, local_path: str, hdfs_path: str | None = None, global_step: int = 0,
                      max_ckpt_to_keep: int | None = None) -> None:
    """Drop-in for FSDPCheckpointManager.save_checkpoint with an incremental SlimCheckpointConfig.

    `original` is verl's unpatched save; it still writes everything but the shards."""
    from verl.utils.fs import local_mkdir_safe

    from . import resume_async, retention

    config = manager.checkpoint_config
    lora_only = bool(manager.should_save_lora_only and manager._has_lora())
    writer = resume_async.writer_for(manager)
    waited = time.perf_counter()
    writer.wait()  # a save starts only once the previous one is committed
    start = time.perf_counter()
    timings = {"wait_previous": start - waited}
    lap = _lap(timings)
    group = checkpoint_group(manager)
    manager.previous_global_step = global_step
    local_path = local_mkdir_safe(local_path)
    drops: list[str] = []
    if manager.rank == 0:
        drops = make_room(manager, max_ckpt_to_keep)
        _clear_stale(local_path)
    dist.barrier(group=group)
    lap("setup")

    contents = [c for c in manager.checkpoint_save_contents if c in SHARD_CONTENTS]
    # verl's own save for huggingface/, fsdp_config.json, LoRA meta and hf_model; retention later
    with save_contents(manager, hf_direct_export.verl_contents(manager, config)), retention.deferred(manager):
        original(manager, local_path, hdfs_path, global_step, None)
    lap("verl_save")

    if manager.should_save_extra:
        save_extra(manager, local_path)
    lap("extra")
    state = build_state_dict(manager, model=manager.should_save_model, optimizer=manager.should_save_optimizer)
    _note_fsdp1_copy(manager, state)
    aliases: dict[str, str] = {}
    if "model" in state:
        if lora_only:  # verl's save_lora_only: the adapter's parameters (the optimizer holds only theirs)
            total = len(state["model"])
            state["model"] = lora_only_state(state["model"])
            _note_lora_only(manager, state["model"], total)
        state["model"], aliases = split_aliases(state["model"])
    lap("state_dict")
    # planned here, in the foreground, from the shards' specs (a staged copy has the same ones)
    export = hf_direct_export.plan_export(manager, local_path, state.get("model", {}), aliases, config, group) \
        if getattr(config, "export_hf", False) else None
    dcp_dir = os.path.join(local_path, DCP_DIR)
    lap("plan_export")

    from ..verl.checkpoint_config import async_mode

    mode = async_mode(getattr(config, "async_save", False))
    if mode == "stream":
        from .stream_capture import StreamCapture, live_tensors

        capture = StreamCapture(state, host_budget.budget_bytes(config),
                                step=int(global_step), live=live_tensors(manager.model, manager.optimizer))
        lap("capture")
        timings["blocking"] = time.perf_counter() - waited
        del state
        writer.submit(global_step, local_path, functools.partial(
            _write_and_commit, manager, capture.state, local_path, dcp_dir, global_step, contents, config, group,
            max_ckpt_to_keep, timings, aliases, export, capture, lora_only=lora_only,
            first=_drop_first(manager, drops)), capture=capture,
            optimizer=manager.optimizer)
        return
    staged = writer.stage(state, config, step=global_step, group=group) if mode == "pool" else None
    if staged is not None:
        lap("stage")
        timings["blocking"] = time.perf_counter() - waited
        del state
        writer.submit(global_step, local_path, functools.partial(
            _write_and_commit, manager, staged, local_path, dcp_dir, global_step, contents, config, group,
            max_ckpt_to_keep, timings, aliases, export, lora_only=lora_only, first=_drop_first(manager, drops)))
        return
    _write_and_commit(manager, state, local_path, dcp_dir, global_step, contents, config, group,
                      max_ckpt_to_keep, timings, aliases, export, lora_only=lora_only, first=_drop_first(manager, drops))


def _write_and_commit(manager, state: dict[str, Any], local_path: str, dcp_dir: str, global_step: int,
                      contents: list[str], config: Any, group: dist.ProcessGroup, max_keep: int | None,
                      timings: dict[str, float], aliases: dict[str, str], export=None, capture=None,
                      lora_only: bool = False, first=None) -> None:
    """DCP shards, then the HF export (both from `state`: the live shards, the staged copy in
    pool mode, or the live shards read through `capture` in stream mode), then the commit.
    Collective over `group`."""
    import torch.distributed.checkpoint as dcp

    start = time.perf_counter()
    try:
        if first is not None:  # rank 0: retention's optimizer drops (make_room), before the shards
            first()
            timings["drop_optimizer"] = time.perf_counter() - start
            start = time.perf_counter()
        known: dict[str, str] = {}
        reads = None
        if capture is not None:
            from .stream_capture import StreamReads

            if export is not None and getattr(config, "export_hf", False):
                reads = StreamReads(capture, state.get("model", {}))
                model_state = state.get("model", {})
                capture.plan_reads("export", reads.keys_for(hf_direct_export.sources_read(export, model_state)))
            if not state:
                capture.start()
        if state:
            writer = storage_writer(dcp_dir, config)
            planner = None
            if capture is not None:
                from .stream_planner import StreamSavePlanner

                planner = StreamSavePlanner(capture)
            try:
                dcp.save(state, storage_writer=writer, planner=planner, process_group=group)
            finally:
                if capture is not None:
                    capture.dcp_done()
            known = written_checksums(writer, local_path)  # hashed as written: no read-back
        timings["write"] = time.perf_counter() - start
        _after_shards(manager, local_path, config, state.get("model", {}), export, group, timings, reads)
        if capture is not None:  # a shard changed under the writer is never committed
            capture.check_collective(group)
            timings["guard_blocked"] = capture.blocked_s
        commit(manager, local_path, global_step, contents, config, group, max_keep, timings, aliases, known,
               lora_only)
    except BaseException as exc:
        from ..format.resume_manifest import write_failure
        from .lost_rank import RankLost, peer_loss_line

        with contextlib.suppress(Exception):
            write_failure(local_path, manager.rank, f"step {global_step}: {type(exc).__name__}: {exc}")
        line = peer_loss_line(exc, local_path, global_step)
        if line is not None and threading.current_thread() is not threading.main_thread():
            # a background write: said now, not only when the next save or the exit waits for it
            log.error("%s", line)
            raise RankLost(line) from exc
        raise


# --------------------------------------------------------------------------- load


def _check_committed(local_path: str, group: dist.ProcessGroup, checksums: bool = True) -> Manifest:
    """resume_manifest.role_damage (the one definition of intact, `slimckpt verify`'s too) shared
    by the ranks: each checks size and checksum of its share of the listed files (about equal
    bytes), rank 0 also looks for unlisted files and failure markers; every rank raises the same
    first message, the line `slimckpt verify` prints for that file."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    manifest, damage = role_damage(local_path, checksums=checksums, share=(rank, world), extras=rank == 0)
    firsts: list[Any] = [None] * world
    dist.all_gather_object(firsts, [(d.index, d.message) for d in damage[:1]], group=group)
    first = min((x for part in firsts for x in part), default=None)
    if first is not None:
        raise UncommittedCheckpoint(first[1])
    if manifest is None:
        raise UncommittedCheckpoint(f"slimckpt: {local_path}/{MANIFEST_NAME} is unreadable on rank {rank}")
    return manifest


def load_resume_state(manager, local_path: str) -> None:
    """Load model, optimizer and extra state written by save_resume_state, at any world size; a
    step whose optimizer state retention dropped loads the rest, saying so in one line."""
    group = checkpoint_group(manager)
    # every rank raises the same one-line error; checksums unless the config says verify: false
    manifest = _check_committed(local_path, group, bool(getattr(manager.checkpoint_config, "verify", True)))
    extra = _extra_path(local_path, manifest.world_size, manager.rank % manifest.world_size)
    refuse_together(group, lambda: dcp_refusals(local_path, [extra]))

    if manager.should_load_optimizer and "optimizer" not in manifest.contents and optimizer_dropped(local_path):
        # retention's keep_optimizer_last dropped it: the step is whole otherwise (see docs/retention.md)
        if manager.rank == 0:
            loads = [c for c in manager.checkpoint_load_contents if c != "optimizer"]
            log.warning("%s", resume_line(local_path, loads))
        with load_contents(manager, [c for c in manager.checkpoint_load_contents if c != "optimizer"]):
            return _load_committed(manager, local_path, manifest, group)
    return _load_committed(manager, local_path, manifest, group)


def _load_committed(manager, local_path: str, manifest: Manifest, group: dist.ProcessGroup) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    from . import optim_capture

    missing = [c for c in ("model", "optimizer", "extra")
               if c in manager.checkpoint_load_contents and c not in manifest.contents]
    if missing:
        raise ValueError(
            f"slimckpt: checkpoint.load_contents asks for {missing} but {local_path} was saved with "
            f"{manifest.contents}; drop them from load_contents"
        )
    with_optim_state = manager.should_load_optimizer and \
        optim_capture.saved_with_state(os.path.join(local_path, DCP_DIR))
    state = build_state_dict(manager, model=manager.should_load_model, optimizer=manager.should_load_optimizer,
                             optimizer_state=with_optim_state)
    aliases = dict(manifest.extra.get("aliases") or {})
    lora_only = bool(manifest.extra.get(LORA_ONLY_KEY)) and "model" in state
    if state:
        from ..read.dcp_pickle import CheckedFileSystemReader, CheckedLoadPlanner

        if "model" in state:
            state["model"] = {k: v for k, v in state["model"].items() if k not in aliases}
        if lora_only:  # the base weights stay those the model was built with (model.path)
            state["model"] = {k: v for k, v in state["model"].items() if is_lora_key(k)}
            if not state["model"]:
                raise ValueError(f"slimckpt: {local_path} holds LoRA weights only (save_lora_only) and this model has "
                                 f"no LoRA adapter; resume with the saving run's LoRA settings "
                                 f"(actor_rollout_ref.model.lora_rank, target_modules)")
        dcp_dir = os.path.join(local_path, DCP_DIR)
        dcp.load(state, storage_reader=CheckedFileSystemReader(dcp_dir), planner=CheckedLoadPlanner(dcp_dir),
                 process_group=group)
        if "model" in state:
            for alias, target in aliases.items():
                state["model"][alias] = state["model"][target]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if "model" in state:
                set_model_state_dict(manager.model, state["model"], options=_load_options(lora_only))
        if "optim" in state:
            optim_capture.apply(manager.model, manager.optimizer, state["optim"], _options())
    if manager.should_load_extra:
        load_extra(manager, local_path, manifest.world_size)
    if manager.rank == 0:
        how = "" if manifest.world_size == manager.world_size else \
            f" (saved at world size {manifest.world_size}, resharded to {manager.world_size})"
        if lora_only:
            how += "; LoRA weights only (save_lora_only): the base weights are the model's own (model.path)"
        log.info("loaded step %s from %s%s", manifest.global_step, local_path, how)
    dist.barrier(group=group)


def load_extra(manager, local_path: str, saved_world: int) -> None:
    """lr scheduler and RNG. The scheduler is the same on every rank. Rank r < saved_world resumes
    saved rank r's RNG exactly; a rank the saved run did not have gets a stream derived from
    saved rank r % saved_world's (rng_reshard), since a copy would repeat that rank's draws. On
    fewer ranks, the streams of the saved ranks beyond the new world size are not resumed."""
    source = manager.rank % saved_world
    extra = load_torch_file(_extra_path(local_path, saved_world, source))
    rng = extra.get("rng")
    if rng is not None:
        if manager.rank >= saved_world:
            rng = rng_reshard.derive_rng_state(rng, manager.rank)
        manager.load_rng_state(rng)
        message = rng_reshard.reshard_message(saved_world, manager.world_size)
        if message and manager.rank == 0:
            log.info("%s", message)
    if extra.get("lr_scheduler") is not None and manager.lr_scheduler is not None:
        manager.lr_scheduler.load_state_dict(extra["lr_scheduler"])


# --------------------------------------------------------------------------- the load patch


def _after_saves_here(manager, local_path: str | None) -> None:
    """What a load waits for first: this manager's background write (a load overwrites the shards
    it may still read, whichever format is loaded) and any other write of `local_path` in this
    process, each until its commit has ended on every rank, as a sync save would have returned;
    then every rank of a manager that saved meets the others, since the rank 0 of a save holds the
    dir's writer lock until its save call returns, after the other ranks' have."""
    from ..read import in_flight
    from . import resume_async

    resume_async.writer_for(manager).wait()
    in_flight.wait_for(local_path)
    group = getattr(manager, "_slimckpt_group", None)  # made on every rank, by their first save or load
    if group is not None:
        dist.barrier(group=group)


def wrap_load_checkpoint(original):
    """FSDPCheckpointManager.load_checkpoint: this tier's format when the directory has it, verl's
    own otherwise, so resume_mode=auto works across both."""

    @functools.wraps(original)
    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        from ..read.locks import reading_if_dir

        _after_saves_here(self, local_path)
        with reading_if_dir(local_path, f"loading it (rank {self.rank})"):  # retention keeps it meanwhile
            with trusting(bool(getattr(self.checkpoint_config, "trust_pickle", False))):
                if local_path is not None and is_resume_state(local_path):
                    return load_resume_state(self, local_path)
                if local_path is not None:  # verl's own load unpickles them unchecked
                    refuse_together(checkpoint_group(self),
                                    lambda: native_refusals(local_path, self.world_size, self.rank))
                if local_path is not None and optimizer_dropped(local_path) and self.should_load_optimizer:
                    loads = [c for c in self.checkpoint_load_contents if c != "optimizer"]
                    if self.rank == 0:
                        log.warning("%s", resume_line(local_path, loads))
                    with load_contents(self, loads):
                        return original(self, local_path, hdfs_path, del_local_after_load)
                return original(self, local_path, hdfs_path, del_local_after_load)

    return load_checkpoint


def finish_pending() -> None:
    """Wait for every background write of this process (scripts call it before destroying the
    process group; atexit calls it too)."""
    from . import resume_async

    resume_async.finish_all()


__all__ = [
    "DCP_DIR", "MANIFEST_NAME", "UncommittedCheckpoint", "build_state_dict", "finish_pending",
    "is_resume_state", "load_resume_state", "save_resume_state", "wrap_load_checkpoint",
]
