"""Streaming merge of a verl FSDP checkpoint into a Hugging Face model dir: plan -> write -> commit.

verl's `python -m verl.model_merger merge --backend fsdp` loads every rank's .pt, casts to bf16,
`torch.cat`s each tensor and `save_pretrained`s: every shard and the whole model in RAM at once
(measured: BENCHMARKS.md's merge table). Here the rank
files are memory-mapped, the safetensors layout is planned up front (`layout`), and each shard's
rows are cast in bounded chunks and written straight to their final offset (`write.share_writer`), by one or
more processes (`--workers`, or ranks of `torchrun ... --distributed_merge`). The directory is
committed atomically with a manifest (`format.merge_manifest`). What is planned is in `plan`; the
command is `cli`, verl's redirected merger `verl_merger`.

The output equals verl's tensor for tensor: names (tied embeddings dropped by verl's own
`drop_tied_target_keys`, `_keys_to_ignore_on_save`, transformers' save-time renamings), dtypes
(bf16 unless --dtype), shapes and values (the same torch cast). config.json and
generation_config.json are written by the same transformers calls save_pretrained makes, the
tokenizer/processor by verl's loaders; a single-file output is byte-identical to verl's.
Differences: no tokenizer is a warning (verl exits 1 after writing); a multi-file split follows
the checkpoint's key order (verl iterates a Python set, so its split varies run to run).
An output that transformers' save splits off a fused tensor (transformers 5 stores an MoE layer's
experts as one `[E, 2I, H]` tensor and saves them per expert) is planned as the run of the source's
elements it is (`hf.naming.HfSide.output_sources`, `layout.Take`) and streamed like any other.
A LoRA checkpoint is planned by `hf.lora.plan_lora` (the base model with peft's names undone plus
`lora_adapter/`, or with `--merge_lora` the adapter merged into the base weights) and streamed the
same way. Models whose save makes tensors that are not one run of one checkpoint
tensor (a transpose, a concatenation) go to verl's own merger, with a log line saying so and the
host memory it takes (`verl_merger_memory`); `MergeOptions.verl_fallback=False` refuses them
instead. Under torchrun (and in the intermediate tier's export) verl's merger runs on rank 0 and
its failure is raised on every rank.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import slimckpt.layout.safetensors_layout as layout
from slimckpt import __version__, env_vars
from slimckpt.dist.heartbeat import Heartbeat, describe_ranks, lost_ranks_line
from slimckpt.dist.outcome import from_rank0, on_every_rank
from slimckpt.engine.checkpoint_dir import CheckpointError
from slimckpt.engine.merge_input import check_source, open_source
from slimckpt.engine.out_files import OutputError
from slimckpt.engine.output_dir import commit, discard_partial, prepare_partial, write_manifest
from slimckpt.engine.race_points import pause
from slimckpt.hf.lay_out import lay_out
from slimckpt.hf.lora import plan_lora
from slimckpt.hf.naming import HfSide, NeedsVerlMerger, default_max_shard_size
from slimckpt.hf.plan import ExportPlan, check_output_room, make_plan
from slimckpt.layout.merge_manifest import (
    DEFAULT_ALGO,
    MANIFEST_NAME,
    CommitError,
    Manifest,
    build_entries,
    check_target,
)
from slimckpt.layout.names import DTYPE_CHOICES, HF_SUBDIR, LORA_ADAPTER_CONFIG, LORA_ADAPTER_DIR
from slimckpt.log import get_logger
from slimckpt.merge.plan import MergeError, MergeOptions, MergeResult
from slimckpt.merge.workers import ProgressBar, is_user_error, run_workers, write_weights
from slimckpt.storage import in_flight
from slimckpt.storage.locks import LockBusy, acquire, reading
from slimckpt.storage.os_errors import MERGE_FIXES, OsErrorFixes, redescribe
from slimckpt.verl_files.in_process_merger import verl_merger_call
from slimckpt.verl_files.leaves import leaf

# lazy imports: torch, transformers and torch.distributed load only where a merge needs them (a bad input fails first)

log = get_logger("slimckpt.merge")
T = TypeVar("T")


def _finish(
    partial: str, target: str, mp: ExportPlan, checksums: dict[str, str], opts: MergeOptions, tokenizer_saved: bool
) -> list[str]:
    if not mp.model_plan.files and mp.adapter_config is not None:  # save_lora_only: lora_adapter/ alone
        missing = [
            n
            for n in [LORA_ADAPTER_CONFIG, *(f.name.split("/")[-1] for f in mp.plan.files)]
            if not os.path.getsize(os.path.join(partial, LORA_ADAPTER_DIR, n))
        ]
        if missing:
            raise MergeError(f"Incomplete LoRA adapter output at {partial}: {LORA_ADAPTER_DIR}/{missing[0]} is empty")
    else:
        try:
            leaf("output_validation").validate_hf_model_output(partial)
        except RuntimeError as exc:
            raise MergeError(str(exc)) from None
    entries = build_entries(partial, known=checksums)
    manifest = Manifest(
        kind="hf_export",
        files=entries,
        tool_version=__version__,
        checksum_algo=DEFAULT_ALGO,
        info={
            "source": {
                "local_dir": opts.source_name or os.path.abspath(opts.local_dir),
                "format": mp.source_format,
                "fsdp_version": mp.fsdp_version,
                "world_size": mp.world_size,
            },
            "dtype": opts.dtype,
            "max_shard_size": layout.parse_size(opts.max_shard_size),
            "weight_files": [f.name for f in mp.model_plan.files],
            "total_size": mp.model_plan.total_size,
            **(
                {"lora_adapter": [f.name for f in mp.plan.files if f not in mp.model_plan.files]}
                if mp.adapter_config is not None
                else {}
            ),
            **({"merge_lora": True} if opts.merge_lora and any(t.delta for t in mp.takes.values()) else {}),
            "tokenizer": tokenizer_saved,
        },
    )
    write_manifest(partial, manifest)
    commit(partial, target, overwrite=opts.overwrite)
    return sorted(entries) + [MANIFEST_NAME]


def _ignore_sigxfsz() -> None:
    # past RLIMIT_FSIZE the kernel sends SIGXFSZ, which kills by default; EFBIG is reported instead
    try:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    except (ValueError, AttributeError):  # not the main thread, or no such signal
        pass


# ------------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------------
def merge(opts: MergeOptions, verl_fallback: Callable[[], None] | None = None) -> MergeResult:
    """Merge `opts.local_dir` into `opts.target_dir`; raises MergeError with a one-line message.
    Called in a training job, it first waits for the commit of that job's save of the step, if
    one is in flight."""
    in_flight.wait_for(opts.local_dir)

    if opts.dtype not in DTYPE_CHOICES:
        raise MergeError(f"--dtype {opts.dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    if opts.workers < 1:
        raise MergeError(f"--workers {opts.workers}: use 1 or more")
    if opts.max_shard_size is not None:
        try:
            layout.parse_size(opts.max_shard_size)
        except layout.LayoutError as exc:
            raise MergeError(f"--max_shard_size: {exc}") from None
    _ignore_sigxfsz()
    try:
        if opts.distributed:
            return merge_distributed(opts, verl_fallback)
        with _source_lock(opts), _target_lock(opts):
            return _merge_local(opts, verl_fallback)
    except (CommitError, layout.LayoutError, LockBusy) as exc:
        raise MergeError(_message(exc, opts.os_fixes)) from None
    except Exception as exc:
        if _is_input_or_output_error(exc):
            raise MergeError(_message(exc, opts.os_fixes)) from None
        raise


def _is_input_or_output_error(exc: BaseException) -> bool:
    return isinstance(exc, (CheckpointError, OutputError))


def _resolve_max_shard_size(opts: MergeOptions) -> None:
    if opts.max_shard_size is None:
        opts.max_shard_size = default_max_shard_size()  # imports transformers


def _target_lock(opts: MergeOptions):
    """The exclusive lock on the target (slimckpt.storage.locks), held from before `<target>.partial` is
    made until the commit: a second merge into it fails at once instead of deleting our partial."""
    target = os.path.abspath(opts.target_dir)
    try:
        return acquire(
            target,
            exclusive=True,
            what=f"merging {os.path.abspath(opts.local_dir)} into it",
            fix="wait for that merge to finish, or choose another --target_dir",
        )
    except OSError:
        # no lock file in an unwritable or full parent: nothing can be written there either, and
        # creating `<target>.partial` next reports it in the usual words
        check_target(target, opts.overwrite, opts.overwrite_hint)
        return contextlib.nullcontext()


def _source_lock(opts: MergeOptions):
    """A shared lock on the checkpoint while it is read: retention does not delete it meanwhile,
    and a step a trainer is still writing is refused."""
    return (
        reading(opts.local_dir, f"merging it into {os.path.abspath(opts.target_dir)}")
        if opts.lock_source
        else contextlib.nullcontext()
    )


def _merge_local(opts: MergeOptions, verl_fallback: Callable[[], None] | None) -> MergeResult:
    t0 = time.perf_counter()
    target = os.path.abspath(opts.target_dir)
    check_target(target, opts.overwrite, opts.overwrite_hint)
    # before any import: a wrong --local_dir fails in milliseconds, not after torch and transformers
    check_source(opts.local_dir, checksums=not opts.source_checked)

    _resolve_max_shard_size(opts)
    planned = open_and_plan(opts)
    if planned is None:
        return run_verl_merger(opts, verl_fallback, t0)
    return _write_and_commit(opts, *planned, t0)


def open_and_plan(opts: MergeOptions) -> tuple[ExportPlan, HfSide] | None:
    """The plan from the rank files, or None when verl's own merger has to do them."""
    ckpt = open_source(opts.local_dir)
    try:
        return plan_or_fallback(ckpt, opts)
    finally:
        ckpt.close()


def plan_or_fallback(ckpt, opts: MergeOptions) -> tuple[ExportPlan, HfSide] | None:
    """The merge plan and HF side, or None when verl's own merger has to do this checkpoint
    (logged with the host memory it takes; a MergeError instead when opts.verl_fallback is off)."""
    hf = HfSide(ckpt.local_dir, opts.dtype, opts.trust_remote_code)
    try:
        if ckpt.has_lora():
            mp = plan_lora(
                ckpt, hf, opts.dtype, opts.max_shard_size, opts.merge_lora, opts.merge_lora_hint, opts.adapter_only
            )
        else:
            if opts.merge_lora:
                log.warning("%s: the checkpoint holds no LoRA weights; merging it as it is", opts.merge_lora_hint)
            mp = make_plan(ckpt, hf, opts.dtype, opts.max_shard_size)
    except NeedsVerlMerger as exc:
        _log_fallback(opts, str(exc), ckpt)
        return None
    return mp, hf


def verl_merger_memory(ckpt) -> tuple[int, int, int]:
    """(bytes, shard bytes, parameters): host memory verl 0.9.1's FSDPModelMerger takes for this
    checkpoint, estimated as the rank model files it loads whole (`torch.load` of every
    `model_world_size_W_rank_r.pt`: the fp32 shards, S bytes) plus the whole model in bf16 (2 bytes
    a parameter: the merged tensors it hands to save_pretrained). For fp32 shards that is 1.5 S,
    what README's table measured (1.5-1.7x the shards at 0.25-1B)."""
    shard_bytes = 0
    for rank in range(ckpt.world_size):
        with contextlib.suppress(OSError):
            shard_bytes += os.path.getsize(ckpt.model_file(rank))
    params = sum(math.prod(t.shape) for t in ckpt.tensors.values())
    return shard_bytes + 2 * params, shard_bytes, params


def human_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _log_fallback(opts: MergeOptions, why: str, ckpt) -> None:
    if ckpt.source_format != "verl_fsdp":  # verl's merger reads verl's rank files only
        raise MergeError(
            f"slimckpt's streaming merge does not handle this checkpoint ({why}), and verl's own "
            f"FSDPModelMerger reads verl's rank files, not dcp/: resume from this step with "
            f"+recipe=intermediate, whose saves verl's merger reads, and merge that save"
        )
    from slimckpt.engine.verl_sources import verl_reads_rank0_alone

    first = verl_reads_rank0_alone(ckpt)
    if first is not None:
        raise MergeError(
            f"slimckpt's streaming merge does not handle this checkpoint ({why}), and verl's own "
            f"FSDPModelMerger would write it wrong: it takes the device mesh from the first key, {first!r}, "
            f"which is not sharded, so it reads {ckpt.model_file(0)} alone and writes rank 0's rows of "
            f"every sharded tensor; not run"
        )
    total, shards, params = verl_merger_memory(ckpt)
    memory = (
        f"about {human_bytes(total)} of host memory (the {human_bytes(shards)} of rank model files, read "
        f"whole, + {params:,} parameters x 2 bytes in bf16)"
    )
    if not opts.verl_fallback:
        raise MergeError(
            f"slimckpt's streaming merge does not handle this checkpoint ({why}), and verl's own "
            f"FSDPModelMerger, which would, holds the whole model: {memory}; not run, as "
            f"{opts.verl_fallback_hint} asks"
        )
    log.warning(
        "slimckpt streaming merge does not handle this checkpoint: %s; running verl's own "
        "FSDPModelMerger instead (not atomic), which takes %s; %s refuses instead",
        why,
        memory,
        opts.verl_fallback_hint,
    )
    if opts.dtype != "bf16":
        raise MergeError(
            f"--dtype {opts.dtype}: verl's merger, which this checkpoint needs, only writes bf16; drop --dtype"
        )


def run_verl_merger(opts: MergeOptions, verl_fallback: Callable[[], None] | None, t0: float) -> MergeResult:
    if verl_fallback is None:
        verl_fallback = verl_merger_call(
            opts.local_dir, opts.target_dir, os.path.join(opts.local_dir, HF_SUBDIR), opts.trust_remote_code
        )
    try:
        verl_fallback()
    except Exception as exc:  # noqa: BLE001 - verl's own failure, reported on one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise MergeError(
            f"verl's FSDPModelMerger (which this checkpoint needs) failed: {type(exc).__name__}: {first}"
        ) from exc
    return MergeResult(os.path.abspath(opts.target_dir), used_verl_merger=True, seconds=time.perf_counter() - t0)


def _write_and_commit(opts: MergeOptions, mp: ExportPlan, hf: HfSide, t0: float) -> MergeResult:
    target = os.path.abspath(opts.target_dir)
    log.info(
        "slimckpt streaming merge: %s -> %s (%d tensors, %.2f GB %s in %d file(s), %d worker(s))",
        opts.local_dir,
        target,
        len(mp.name_map),
        mp.weight_bytes / 1e9,
        opts.dtype,
        len(mp.plan.files),
        opts.workers,
    )
    check_output_room(opts.local_dir, target, mp)
    partial = prepare_partial(target)
    ok = False
    try:
        tokenizer_saved = lay_out(partial, mp, hf)
        checksums = write_weights(opts, partial, mp)
        files = _finish(partial, target, mp, checksums, opts, tokenizer_saved)
        ok = True
    finally:
        if not ok:
            discard_partial(partial)
    seconds = time.perf_counter() - t0
    log.info("slimckpt merge committed %s in %.1f s (%s written last)", target, seconds, MANIFEST_NAME)
    return MergeResult(target, files, mp.weight_bytes, seconds, False, tokenizer_saved)


def _message(exc: BaseException, fixes: OsErrorFixes = MERGE_FIXES) -> str:
    line = redescribe(exc, fixes)  # a full or unwritable output: the fix of whoever asked for the merge
    if line is not None:
        return line
    return (
        str(exc)
        if is_user_error(exc) or isinstance(exc, (layout.LayoutError, LockBusy))
        else f"{type(exc).__name__}: {exc}"
    )


def merge_distributed(opts: MergeOptions, verl_fallback: Callable[[], None] | None = None) -> MergeResult:
    """One rank of `torchrun ... slimckpt merge --distributed_merge`: ranks share the writing.

    Rank 0 plans, writes config/tokenizer/headers into `<target>.partial`, and broadcasts the
    plan; every rank writes its share (`--workers` processes each) into the shared files; rank 0
    commits once all have reported. Ranks on several nodes need one filesystem for the target.
    Every rank gets the same outcome: a failure anywhere is raised on all of them.
    """
    import torch.distributed as dist

    _resolve_max_shard_size(opts)
    own_group, beat, store = False, None, None
    if not dist.is_initialized():
        unset = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if env_vars.foreign(k) is None]
        if unset:
            raise MergeError(
                f"{opts.distributed_hint}: start it with torchrun ({'/'.join(unset)} unset), "
                "or drop it and use --workers N on one node"
            )
        store = _join_ranks(opts, dist)
        # once every rank is in, a collective may wait while the others write their shares (long at
        # 70B on a slow disk): the work keeps a long timeout, the join above a short one
        dist.init_process_group(
            "gloo",
            store=store,
            rank=int(env_vars.foreign("RANK")),
            world_size=int(env_vars.foreign("WORLD_SIZE")),
            timeout=timedelta(hours=4),
        )
        own_group = True
        beat = _watch_peers(opts, store)
    try:
        try:
            with _source_lock(opts):
                return _merge_ranks(opts, verl_fallback, dist)
        except LockBusy as exc:  # this rank's read lock (the others fail at their next collective)
            raise MergeError(str(exc)) from None
        except Exception as exc:  # a collective that lost a rank: name it
            lost = lost_ranks_line(exc, beat)
            if lost is None:
                raise
            raise MergeError(
                f"{opts.distributed_hint}: {lost}; nothing was committed ({opts.target_dir} not written): rerun the merge"
            ) from None
    except MergeError as exc:
        if store is not None:
            report_together(exc, store, int(env_vars.foreign("WORLD_SIZE")))
        raise
    finally:
        if beat is not None:
            beat.stop()
        held = opts.__dict__.pop("_held_target_lock", None)
        if held is not None:
            held.release()
        if own_group:
            dist.destroy_process_group()


REPORTED_KEY = "merge_error_reported"
REPORT_WAIT_S = 5.0


def report_together(exc: MergeError, store, world: int, wait_s: float = REPORT_WAIT_S) -> None:
    """Write this rank's one error line now, then wait (up to `wait_s`) until every rank has written
    its own: torchrun ends the ranks still running as soon as one exits with an error, which could
    cut off a rank that had not printed yet. A rank that never reports (lost) costs the wait."""
    sys.stderr.write(f"slimckpt merge: error: {exc}\n")
    sys.stderr.flush()
    exc.reported = True
    try:
        store.add(REPORTED_KEY, 1)
        deadline = time.monotonic() + wait_s
        while store.add(REPORTED_KEY, 0) < world and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - the store's host is gone: nobody is left to wait for
        return


PEER_TIMEOUT_ENV = "SLIMCKPT_MERGE_PEER_TIMEOUT"  # seconds a rank's heartbeat may stop before the others give up


def _watch_peers(opts: MergeOptions, store):
    """Every rank beats in the merge's store; one whose beat stops for SLIMCKPT_MERGE_PEER_TIMEOUT
    seconds (killed, or stopped) ends the others with a line naming it. The group's own timeout is
    hours, as a collective here may wait for the others' writes, so it cannot tell a slow rank from
    a dead one. The exit is immediate (os._exit): the main thread is inside a collective that only
    that timeout would end; `<target>.partial` stays uncommitted and the next run replaces it, and
    the flocks go with the process."""
    seconds = _env_seconds(PEER_TIMEOUT_ENV)
    rank, world = int(env_vars.foreign("RANK")), int(env_vars.foreign("WORLD_SIZE"))
    beat = Heartbeat(store, rank, world, prefix="alive").start()

    def give_up(ranks: list[int], note: str) -> None:
        sys.stderr.write(
            f"slimckpt merge: error: {opts.distributed_hint}: {describe_ranks(ranks, world)} stopped "
            f"answering for {seconds:.0f} s ({note or 'killed or stopped'}; this is rank {rank}); nothing "
            f"was committed ({opts.target_dir} not written): rerun the merge, or set "
            f"{PEER_TIMEOUT_ENV}=<seconds> to wait longer\n"
        )
        sys.stderr.flush()
        os._exit(1)

    beat.watch(seconds, give_up)
    return beat


JOIN_TIMEOUT_ENV = "SLIMCKPT_MERGE_JOIN_TIMEOUT"  # seconds every rank of a distributed merge has to join


def _env_seconds(name: str) -> float:
    """A timeout in seconds from the environment variable `name` (unset: its declared default); anything
    but a number > 0 is a one-line MergeError."""
    try:
        return env_vars.seconds(name)
    except env_vars.BadValue as exc:
        raise MergeError(str(exc)) from None


def join_timeout_s() -> float:
    return _env_seconds(JOIN_TIMEOUT_ENV)


def _join_ranks(opts: MergeOptions, dist):
    """The store every rank of a distributed merge meets in, once all WORLD_SIZE ranks have
    announced themselves in it, within SLIMCKPT_MERGE_JOIN_TIMEOUT seconds (10 minutes). A rank
    that never comes (a shell that only looks like torchrun's, a node that did not start) ends
    every other rank with a line naming the missing ranks, instead of init_process_group's wait.
    Under torchrun the agent's store is used, as torch's env:// rendezvous does."""
    rank, world = int(env_vars.foreign("RANK")), int(env_vars.foreign("WORLD_SIZE"))
    addr, port = env_vars.foreign("MASTER_ADDR"), int(env_vars.foreign("MASTER_PORT"))
    seconds = join_timeout_s()
    agent = env_vars.foreign("TORCHELASTIC_USE_AGENT_STORE") == "True"
    fix = (
        f"start all {world} ranks with the same MASTER_ADDR:MASTER_PORT ({addr}:{port}) and reachable from "
        f"each other, or set {JOIN_TIMEOUT_ENV}=<seconds> to wait longer"
    )
    try:
        store = dist.TCPStore(
            addr,
            port,
            world,
            is_master=rank == 0 and not agent,
            timeout=timedelta(seconds=seconds),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except (RuntimeError, OSError) as exc:  # DistStoreError / DistNetworkError are RuntimeErrors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MergeError(
            f"{opts.distributed_hint}: rank {rank} of {world} could not reach rank 0's store at "
            f"{addr}:{port} within {seconds:.0f} s ({first}); {fix}"
        ) from None
    attempt = env_vars.foreign("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"slimckpt_merge/attempt_{attempt}", store)
    store.set(f"joined/{rank}", "1")
    deadline = time.monotonic() + seconds
    while True:
        missing = [r for r in range(world) if not store.check([f"joined/{r}"])]
        if not missing:
            return store
        if time.monotonic() > deadline:
            raise MergeError(
                f"{opts.distributed_hint}: rank(s) {', '.join(map(str, missing))} of {world} did not join "
                f"within {seconds:.0f} s (this is rank {rank}); {fix}"
            )
        time.sleep(0.2)


def _merge_ranks(opts: MergeOptions, verl_fallback, dist) -> MergeResult:
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    target = os.path.abspath(opts.target_dir)
    said = lambda exc: _message(exc, opts.os_fixes)  # noqa: E731 - every rank's line names the caller's fix
    as_is = lambda failure: MergeError(failure.line)  # noqa: E731

    def plan_on_rank0():
        opts.__dict__["_held_target_lock"] = _target_lock(opts)  # released by merge_distributed
        check_target(target, opts.overwrite, opts.overwrite_hint)
        check_source(opts.local_dir, checksums=not opts.source_checked)
        planned = open_and_plan(opts)
        if planned is None:
            return None
        mp, hf = planned
        log.info(
            "slimckpt streaming merge: %s -> %s (%d tensors, %.2f GB %s in %d file(s), %d rank(s) x %d worker(s))",
            opts.local_dir,
            target,
            len(mp.name_map),
            mp.weight_bytes / 1e9,
            opts.dtype,
            len(mp.plan.files),
            world,
            opts.workers,
        )
        check_output_room(opts.local_dir, target, mp)
        partial = prepare_partial(target)
        try:
            laid_out = mp, partial, lay_out(partial, mp, hf)
            pause("laid_out")
            return laid_out
        except BaseException:
            discard_partial(partial)
            raise

    planned = _plain(lambda: from_rank0(None, plan_on_rank0, as_is, said))
    if planned is None:
        # rank 0 runs verl's merger; every rank then hears how it ended (no barrier that waits for a
        # merge that died: its error is raised on every rank)
        return _plain(
            lambda: from_rank0(
                None,
                lambda: run_verl_merger(opts, verl_fallback, t0),
                as_is,
                lambda exc: f"verl's merger exited: {exc}" if isinstance(exc, SystemExit) else said(exc),
                catch=(Exception, SystemExit),
            )
        )
    mp, partial, tokenizer_saved = planned

    # every rank writes its shares; then the files no single writer wrote whole are read back,
    # spread over the ranks
    shares = layout.partition(mp.plan, world * opts.workers)[rank * opts.workers : (rank + 1) * opts.workers]
    mine = sum(
        mp.plan.placements[s.name].rows_to_bytes(s.row_start, s.row_end)[1]
        - mp.plan.placements[s.name].rows_to_bytes(s.row_start, s.row_end)[0]
        for sh in shares
        for s in sh
    )
    on_a_rank = lambda failure: MergeError(f"merge rank {failure.rank}: {failure.line}")  # noqa: E731
    try:
        bar = ProgressBar(mine, opts.progress and rank == 0, f"slimckpt merge (rank 0 of {world})")
        try:
            written = _plain(
                lambda: on_every_rank(
                    None,
                    lambda: _written(
                        run_workers(opts.local_dir, partial, mp, shares, opts.dtype, opts.chunk_bytes, bar, opts.fsync)
                    ),
                    on_a_rank,
                    said,
                )
            )
        finally:
            bar.close()
        checksums = _union(dist, written)
        missing = sorted(f.name for f in mp.plan.files if f.name not in checksums)
        checksums.update(
            _union(
                dist,
                _plain(lambda: on_every_rank(None, lambda: _read_back(partial, missing[rank::world]), on_a_rank, said)),
            )
        )
    except MergeError:
        if rank == 0:
            discard_partial(partial)
        raise

    def commit_on_rank0() -> list[str]:
        try:
            pause("commit")
            return _finish(partial, target, mp, checksums, opts, tokenizer_saved)
        except BaseException:
            discard_partial(partial)
            raise

    files = _plain(lambda: from_rank0(None, commit_on_rank0, as_is, said))
    seconds = time.perf_counter() - t0
    if rank == 0:
        log.info("slimckpt merge committed %s in %.1f s (%s written last)", target, seconds, MANIFEST_NAME)
    return MergeResult(target, files, mp.weight_bytes, seconds, False, tokenizer_saved)


def _written(checksums: dict[str, str]) -> dict[str, str]:
    pause("written")  # this rank's writers have closed; the outcome collective waits for the others
    return checksums


def _read_back(partial: str, names: list[str]) -> dict[str, str]:
    from slimckpt.engine.share_writer import checksum_files

    pause("read_back")
    return checksum_files(partial, names)


def _plain(outcome: Callable[[], T]) -> T:
    """`outcome()` (a collective.outcome call), its MergeError raised with no OSError under it: the
    line names the rank and the caller's fix already, and a trainer's failed save (the
    intermediate tier's export) describes the OS error under an error again where it finds one."""
    try:
        return outcome()
    except MergeError as exc:
        error = exc
    error.__cause__ = error.__context__ = None
    raise error


def _union(dist, mine: dict[str, str]) -> dict[str, str]:
    """Every rank's checksums, on every rank."""
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    return {k: v for part in found for k, v in part.items()}
