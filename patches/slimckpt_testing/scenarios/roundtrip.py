"""verl's checkpoint round trip (its tests/special_distributed/test_fsdp_ckpt.py) on CPU: gloo, 2
ranks, a tiny Llama, verl's real FSDPCheckpointManager with the incremental tier, for every
async_save mode in one launch per strategy; run by tests/storage/test_in_flight.py:

    torchrun --nproc_per_node 2 -m slimckpt_testing.launch slimckpt_testing.scenarios.roundtrip --dir D --fsdp {1,2} [--repeat N]

Per mode (sync, pool, stream), each with a fresh model:
1. round trip, as verl's test: update, save, update, logits; load, the shards equal the saved
   ones bit for bit; repeat the second update: the logits equal those before the load bit for bit.
2. in flight, with rank 0's commit held back (its manifest written `--delay` s late): right after a
   save, rank 0 verifies the step in-process and then merges the next one, while rank 1 loads it
   at once; every call must see the committed step.
3. a commit that fails on rank 0 (its manifest write hits a full disk): the load (async) or the
   save (sync) raises on every rank, the same line on each.

Rank 0 writes D/roundtrip_fsdp{V}_result.json: {mode: [one dict per repeat]}.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import faulthandler
import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import slimckpt_testing.scenarios.tiny_run as tiny_run

# lazy imports: slimckpt's save path and verl's manager load inside a mode, after it set the switches they read

MODES = {"sync": False, "pool": True, "stream": "stream"}


def _update(run: tiny_run.Run, ids: torch.Tensor) -> None:
    """One update as verl's test makes it: logits.mean() as the loss."""
    run.model(input_ids=ids).logits.mean().backward()
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad()


def _logits(run: tiny_run.Run, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return run.model(input_ids=ids).logits.clone()


def _shards(run: tiny_run.Run) -> dict[str, torch.Tensor]:
    """This rank's part of every parameter, copied."""
    return {
        n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in run.model.named_parameters()
    }


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n for n in a.keys() | b.keys() if n not in a or n not in b or not torch.equal(a[n], b[n]))


class _Commit:
    """step_commit.write_manifest on rank 0, held back `delay` s, or failing with ENOSPC."""

    def __init__(self) -> None:
        from slimckpt.save import step_commit

        self.module, self.real = step_commit, step_commit.write_manifest
        self.delay, self.fail = 0.0, False

    def __enter__(self) -> _Commit:
        def write_manifest(role_dir, manifest):
            # held back so the verify, merge and load started right after the save find the commit in flight
            time.sleep(self.delay)
            if self.fail:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(role_dir, "slimckpt_resume.json"))
            return self.real(role_dir, manifest)

        self.module.write_manifest = write_manifest
        return self

    def __exit__(self, *exc) -> None:
        self.module.write_manifest = self.real


def _raised(call) -> str | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the line a user would see is the result
        return f"{type(exc).__name__}: {exc}"
    return None


def round_trip(root: str, mode: str, seed: int) -> dict:
    run = tiny_run.Run(seed=seed, ckpt_config=tiny_run.slim_config(async_save=MODES[mode], host_memory_budget_gb=1.0))
    gen = torch.Generator().manual_seed(seed)
    ids1, ids2 = (torch.randint(0, tiny_run.VOCAB, (2, 16), generator=gen) for _ in range(2))
    path = os.path.join(root, "checkpoint")
    _update(run, ids1)
    run.manager.save_checkpoint(path, global_step=1)
    saved = _shards(run)
    _update(run, ids2)
    before = _logits(run, ids2)
    run.manager.load_checkpoint(path)
    loaded = _differ(_shards(run), saved)
    _update(run, ids2)
    after = _logits(run, ids2)
    return {"shards_differ": loaded, "logits_equal": bool(torch.equal(before, after)), "run": run}


def in_flight(root: str, run: tiny_run.Run, delay: float) -> dict:
    """verify, merge and load right after saves whose commit on rank 0 is held back."""
    from slimckpt.merge.pipeline import merge
    from slimckpt.merge.plan import MergeOptions
    from slimckpt.verify.command import verify_path

    out: dict = {}
    with _Commit() as commit:
        commit.delay = delay
        step2 = os.path.join(root, "global_step_2", "actor")
        run.manager.save_checkpoint(step2, global_step=2)
        if dist.get_rank() == 0:
            report = verify_path(step2)
            out["verify"] = [p.message for p in report.bad] or "ok"
        step3 = os.path.join(root, "global_step_3", "actor")
        run.manager.save_checkpoint(step3, global_step=3)
        saved = _shards(run)
        if dist.get_rank() == 0:
            target = os.path.join(root, "merged")
            out["merge"] = _raised(
                lambda: merge(MergeOptions(local_dir=step3, target_dir=target, dtype="fp32", progress=False))
            ) or sorted(os.listdir(target))
        _update(run, torch.randint(0, tiny_run.VOCAB, (2, 16)))
        out["load"] = _raised(lambda: run.manager.load_checkpoint(step3))
        out["load_shards_differ"] = _differ(_shards(run), saved) if out["load"] is None else None

        commit.delay, commit.fail = 0.0, True
        step4 = os.path.join(root, "global_step_4", "actor")
        out["failed_save"] = _raised(lambda: run.manager.save_checkpoint(step4, global_step=4))
        out["failed_load"] = _raised(lambda: run.manager.load_checkpoint(step4))
        out["failed_committed"] = os.path.exists(os.path.join(step4, "slimckpt_resume.json"))
    return out


def one(root: str, mode: str, seed: int, delay: float | None) -> dict:
    os.makedirs(root, exist_ok=True)
    result: dict = {}
    try:
        result = round_trip(root, mode, seed)
        run = result.pop("run")
        if delay is not None:
            result.update(in_flight(root, run, delay))
    except Exception:  # noqa: BLE001 - recorded; the other modes still run
        result["error"] = traceback.format_exc()[-3000:]
    from slimckpt.save.resume_state import finish_pending

    finish_pending()
    results: list = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    return {"ranks": results}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--fsdp", type=int, choices=[1, 2], default=2)
    p.add_argument("--repeat", type=int, default=1)
    # 0.5 s: the verify, merge and load start well before the manifest lands; short per mode
    p.add_argument("--delay", type=float, default=0.5, help="s rank 0's commit is held back in the in-flight part")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--round-trip-only", action="store_true", help="verl's round trip alone (no part 2 and 3)")
    # a healthy collective here waits seconds; 60 s ends a mode whose peer raised alone
    p.add_argument("--timeout", type=int, default=60, help="s a collective may wait (a rank that raised alone)")
    # under test_load_waits' 600 s: the stacks are dumped before the test kills the tree
    p.add_argument("--deadline", type=int, default=540, help="s the whole run may take")
    return p.parse_args(argv)


def pg_timeout_s(args: argparse.Namespace) -> float:
    """How long the launcher's process group lets a collective wait."""
    # 3x: the checkpoint's own groups give up first, so a failure ends one mode, not the run
    return 3 * args.timeout


def run(args: argparse.Namespace) -> None:
    tiny_run.FSDP_VERSION = args.fsdp
    faulthandler.dump_traceback_later(args.deadline, exit=True)  # a hang shows its stacks before the test gives up
    # the groups made later (the checkpoint's own gloo group) give up sooner than the launcher's: a
    # load that raised on one rank only ends that mode, and the ranks meet again in one()
    c10d.default_pg_timeout = datetime.timedelta(seconds=args.timeout)
    out: dict = {}
    for i in range(args.repeat):
        for mode in args.modes.split(","):
            root = os.path.join(args.dir, f"fsdp{args.fsdp}_{mode}_{i}")
            out.setdefault(mode, []).append(one(root, mode, seed=i, delay=None if args.round_trip_only else args.delay))
    tiny_run.write_result(args, f"roundtrip_fsdp{args.fsdp}", out)
