"""The merge shared by the ranks of `torchrun ... slimckpt merge --distributed_merge`: the ranks join
one store within SLIMCKPT_MERGE_JOIN_TIMEOUT, beat in it so that a rank that stops answering is named
(SLIMCKPT_MERGE_PEER_TIMEOUT), rank 0 plans and lays the output out, every rank writes its share, and
every rank ends with the same outcome, its one error line written before torchrun ends the others."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import slimckpt.layout.safetensors_layout as layout
from slimckpt import env_vars
from slimckpt.dist.heartbeat import Heartbeat, describe_ranks, lost_ranks_line
from slimckpt.dist.outcome import from_rank0, on_every_rank
from slimckpt.engine.merge_input import check_source
from slimckpt.engine.output_dir import discard_partial, prepare_partial
from slimckpt.engine.race_points import pause
from slimckpt.hf.lay_out import lay_out
from slimckpt.hf.plan import check_output_room
from slimckpt.layout.merge_manifest import check_target
from slimckpt.log import get_logger
from slimckpt.merge.plan import MergeError, MergeOptions, MergeResult
from slimckpt.merge.steps import (
    finish,
    log_committed,
    log_start,
    message,
    open_and_plan,
    resolve_max_shard_size,
    source_lock,
    target_lock,
)
from slimckpt.merge.verl_fallback import run_verl_merger
from slimckpt.merge.workers import ProgressBar, run_workers
from slimckpt.storage.locks import LockBusy

# lazy imports: torch.distributed and the read-back's checksums load only where a distributed merge runs

log = get_logger("slimckpt.merge")
T = TypeVar("T")


def merge_distributed(opts: MergeOptions, verl_fallback: Callable[[], None] | None = None) -> MergeResult:
    """One rank of `torchrun ... slimckpt merge --distributed_merge`: ranks share the writing.

    Rank 0 plans, writes config/tokenizer/headers into `<target>.partial`, and broadcasts the
    plan; every rank writes its share (`--workers` processes each) into the shared files; rank 0
    commits once all have reported. Ranks on several nodes need one filesystem for the target.
    Every rank gets the same outcome: a failure anywhere is raised on all of them.
    """
    import torch.distributed as dist

    resolve_max_shard_size(opts)
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
            with source_lock(opts):
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
    said = lambda exc: message(exc, opts.os_fixes)  # noqa: E731 - every rank's line names the caller's fix
    as_is = lambda failure: MergeError(failure.line)  # noqa: E731

    def plan_on_rank0():
        opts.__dict__["_held_target_lock"] = target_lock(opts)  # released by merge_distributed
        check_target(target, opts.overwrite, opts.overwrite_hint)
        check_source(opts.local_dir, checksums=not opts.source_checked)
        planned = open_and_plan(opts)
        if planned is None:
            return None
        mp, hf = planned
        log_start(opts, target, mp, ranks=world)
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
            return finish(partial, target, mp, checksums, opts, tokenizer_saved)
        except BaseException:
            discard_partial(partial)
            raise

    files = _plain(lambda: from_rank0(None, commit_on_rank0, as_is, said))
    seconds = time.perf_counter() - t0
    if rank == 0:
        log_committed(target, seconds)
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
