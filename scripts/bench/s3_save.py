#!/usr/bin/env python
"""One incremental step written through slimckpt's engine to local disk and to a local S3 server, same run.

  make bench-s3                                            # llama3.2-3b (3.61B), 3 pairs -> BENCHMARKS.md
  python -m scripts.bench.s3_save --preset 0.25b --repeat 3 --out /tmp/s.md --json /tmp/s.json
  python -m scripts.bench.s3_save --preset llama3.2-3b --repeat 1 --out /tmp/s.md --json /tmp/s.json  # one pair
  python -m scripts.bench.s3_save --render docs/bench_s3_save.json --out BENCHMARKS.md     # re-render, no runs

Each row is one fresh `torchrun --nproc_per_node 2` (FSDP2, gloo, CPU) that builds the preset's Llama
(scripts.bench.save.build_model, random fp32 weights, each rank materialising only its shard, an SGD
optimizer without state) and then times one `save_resume_state` of `[model, extra]` with
`CheckpointOptions(recipe="incremental", incremental_save=True, async_save=False)` (no HF export), the
SaveTarget built by hand as slimckpt_testing/scenarios/s3_engine_step.py does. Targets:

  disk  a fresh local dir under --work, deleted after the row
  s3    `s3://` on a fresh SeaweedFS (`weed mini`, slimckpt_testing.s3_server) whose data lives under
        --work on the same disk, stopped and its dir deleted after the row (SeaweedFS frees deleted
        space only on vacuum)

The rows run disk, s3, disk, s3, ... (--repeat pairs), so both targets see the same machine state.
Wall: from a barrier before the save to the barrier after every rank's save returned, i.e. the step
committed and durable (disk: fsynced and its manifest renamed into place; S3: every multipart upload
completed and the manifest's conditional PUT answered). Memory: each rank's peak RssAnon above its
level just before the save, sampled every 5 ms by a process of its own (scripts.bench.save's sampler).
CPU seconds: the ranks' (user + system, all threads) during the save, plus the server's over the row.
S3 settings (`SLIMCKPT_S3_PART_MB`, `SLIMCKPT_S3_CONCURRENCY`) are the backend's defaults unless given;
the bound a rank's rise is checked against is part x concurrency x write_threads + 64 MiB.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from scripts.bench.s3_save_report import BIG, GB, TARGETS, GiB, MiB, render_section
from scripts.bench.save import machine_line, mem_available, preset_params
from scripts.bench.save_report import write_section
from scripts.bench.scale import choose_cap, enough_disk, run_capped
from scripts.provenance import source_commit

# lazy imports: torch, boto3 and slimckpt's engine load in the worker ranks (and the server helper) only

REPO = Path(__file__).resolve().parents[2]
TAG = "[bench-s3]"


# --------------------------------------------------------------------------- worker (one torchrun rank)


def side_files(config):
    """verl's own files of a step (fsdp_config.json, huggingface/config.json), written through the
    storage of the path by rank 0, as verl's manager writes them."""

    def write(local_path: str, _contents: list[str]) -> None:
        import torch.distributed as dist

        from slimckpt.storage import for_path

        if dist.get_rank() != 0:
            return
        store = for_path(local_path)
        fsdp = json.dumps({"FSDP_version": 2, "world_size": dist.get_world_size()}).encode()
        store.put_atomic(os.path.join(local_path, "fsdp_config.json"), fsdp)
        store.make_dirs(os.path.join(local_path, "huggingface"), exist_ok=True)
        store.put_atomic(os.path.join(local_path, "huggingface", "config.json"), config.to_json_string().encode())

    return write


def stored_bytes(path: str) -> tuple[int, int]:
    """(files, bytes) of the step at `path`, through its storage."""
    from slimckpt.storage import for_path

    store = for_path(path)
    names = store.list_files(path)
    return len(names), sum(store.size(f"{path.rstrip('/')}/{n}") for n in names)


def warm_up(path: str, rank: int) -> dict:
    """The storage of `path` used once, as a run's first save would: access checked, an object of one
    upload part and a MiB (S3: a multipart upload of two parts) written beside the step and removed."""
    from slimckpt.storage import for_path

    store = for_path(path)
    store.check_access(path)
    part = MiB
    if path.startswith("s3://"):
        from slimckpt.storage import s3_client

        part = s3_client.part_bytes()
    probe = f"{path.rstrip('/').rsplit('/', 2)[0]}/warmup/rank{rank}.bin"
    store.make_dirs(probe.rsplit("/", 1)[0], exist_ok=True)
    block = bytes(MiB)
    with store.open_stream(probe) as f:
        for _ in range(part // MiB + 1):
            f.write(block)
    store.remove(probe)
    return {}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import slimckpt.save.modes.writer as resume_async
    from scripts.bench.rss_window import WindowSampler
    from scripts.bench.save import build_model, measured
    from slimckpt.options.checkpoint_options import CheckpointOptions
    from slimckpt.save.step_save import save_resume_state
    from slimckpt.save.target import SaveTarget, TargetState, fsdp_version_of

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = WindowSampler()
    model, optimizer, scheduler, n_params, _vocab = build_model(args.preset, world, adamw_state=False)
    options = CheckpointOptions(
        recipe="incremental", incremental_save=True, async_save=False, measure=False, export_hf=False
    )
    state = TargetState()
    target = SaveTarget(
        model=model,
        optimizer=optimizer,
        options=options,
        state=state,
        rank=rank,
        world_size=world,
        lr_scheduler=scheduler,
        save_contents=("model", "extra"),
        fsdp_version=fsdp_version_of(model),
        get_rng_state=torch.get_rng_state,
        load_rng_state=torch.set_rng_state,
        side_files=side_files(model.config),
    )

    def save() -> dict:
        before = os.times()
        save_resume_state(target, args.path, 1)
        resume_async.writer_for(state).wait()
        after = os.times()
        return {"cpu_s": (after.user - before.user) + (after.system - before.system)}

    # before the save's window: the client made (boto3 imported, the bucket checked) and one object of
    # a part and a MiB written through the same upload path and removed, as at any save after a run's
    # first; what that costs once is measured too
    first = measured(sampler, lambda: warm_up(args.path, rank), "connect", "connected")
    got = measured(sampler, save, "save", "saved")
    sampler.close()
    row = {
        "rank": rank,
        "params": n_params,
        "wall_s": got["wall_s"],
        "cpu_s": got["cpu_s"],
        "level_before": got["level_before"],
        "peak": got["peak"],
        "write_threads": options.write_threads,
        "connect_s": first["wall_s"],
        "connect_rise": first["peak"] - first["level_before"],
    }
    if args.path.startswith("s3://"):
        from slimckpt.storage import s3_client

        row.update(part_bytes=s3_client.part_bytes(), concurrency=s3_client.concurrency())
    if rank == 0:
        row["files"], row["bytes"] = stored_bytes(args.path)
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(args.out, "result.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- driver


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class PeakSampler:
    """The server process's peak RssAnon, sampled every 50 ms on a thread of the driver, and the CPU
    seconds it spent from the sampler's start to its stop."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self.cpu0, self.cpu_s = cpu_seconds(pid), 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        from slimckpt.observe.memory import rss_anon_bytes

        while not self.done.wait(0.05):
            try:
                self.peak = max(self.peak, rss_anon_bytes(self.pid))
            except OSError:
                return

    def stop(self) -> int:
        if not self.done.is_set():
            self.done.set()
            self.thread.join(timeout=5)
            try:
                self.cpu_s = cpu_seconds(self.pid) - self.cpu0
            except OSError:
                pass
        return self.peak


def tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def s3_settings(args: argparse.Namespace) -> dict[str, int]:
    """The part size (MiB) and concurrency the S3 rows use: given, else the backend's defaults."""
    from slimckpt import env_vars

    return {
        "part_mb": args.part_mb or env_vars.integer("SLIMCKPT_S3_PART_MB"),
        "concurrency": args.concurrency or env_vars.integer("SLIMCKPT_S3_CONCURRENCY"),
    }


def run_row(preset: str, target: str, rep: int, args: argparse.Namespace, cap: int) -> dict:
    """One torchrun saving `preset` to `target` (a fresh dir, or a fresh server); the row's numbers."""
    from slimckpt_testing import s3_server

    work = Path(args.work)
    scratch = Path(tempfile.mkdtemp(prefix=f"s3save-{preset}-{target}-", dir=work))
    server, watcher = None, None
    settings = s3_settings(args)
    env = {
        "OMP_NUM_THREADS": "1",
        "SLIMCKPT_LOG_LEVEL": "WARNING",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "patches"), os.environ.get("PYTHONPATH")])),
        "SLIMCKPT_S3_PART_MB": str(settings["part_mb"]),
        "SLIMCKPT_S3_CONCURRENCY": str(settings["concurrency"]),
    }
    try:
        if target == "s3":
            server = s3_server.start(root=str(scratch))
            env.update(server.env)
            path = server.url(f"{preset}-{rep}") + "/global_step_1/actor"
            watcher = PeakSampler(server.proc.pid)
        else:
            path = str(scratch / "ckpt" / "global_step_1" / "actor")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "scripts.bench.s3_save",
            "--worker",
            "--preset",
            preset,
            "--path",
            path,
            "--scratch",
            str(scratch),
        ]
        got = run_capped(cmd, env, cap, timeline_s=1.0, cwd=REPO)
        server_peak = watcher.stop() if watcher else None
        on_server_disk = tree_bytes(server.root / "data") if server else None
        result = scratch / "result.json"
        ranks = json.loads(result.read_text()) if result.exists() and not got["killed"] else None
    finally:
        if watcher:
            watcher.stop()
        if server:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    if ranks is None:
        log = work / f"s3save-{preset}-{target}.log"
        log.write_text(got["output"])
        why = f"killed past the cap ({cap / GiB:.1f} GiB)" if got["killed"] else f"exit {got['returncode']}"
        raise SystemExit(f"{TAG} {preset} {target} failed ({why}); log {log}:\n{got['output'][-3000:]}")
    r0 = ranks[0]
    row = {
        "preset": preset,
        "target": target,
        "rep": rep,
        "params": r0["params"],
        "wall_s": max(r["wall_s"] for r in ranks),
        "ranks_cpu_s": sum(r.get("cpu_s", 0.0) for r in ranks),
        "rise_per_rank": [r["peak"] - r["level_before"] for r in ranks],
        "tree_peak": got["peak_rss_anon"],
        "files": r0["files"],
        "bytes": r0["bytes"],
        "write_threads": r0["write_threads"],
        "connect_s": max(r["connect_s"] for r in ranks),
        "connect_rise_per_rank": [r["connect_rise"] for r in ranks],
    }
    if target == "s3":
        row.update(
            part_bytes=r0["part_bytes"],
            concurrency=r0["concurrency"],
            server_peak=server_peak,
            server_cpu_s=watcher.cpu_s,
            on_server_disk=on_server_disk,
        )
    print(
        f"{TAG} {preset} {target} #{rep + 1}: {row['wall_s']:.1f} s, {row['bytes'] / GB:.2f} GB, "
        f"rise {' / '.join(f'{v / MiB:.0f}' for v in row['rise_per_rank'])} MiB",
        flush=True,
    )
    return row


def measure(args: argparse.Namespace) -> dict | None:
    started = time.perf_counter()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    # one step is written at a time, its dir deleted before the next: its size and a margin
    need = preset_params(args.preset) * 4 / GiB * 1.1 + 2
    if not enough_disk(work, need, "bench-s3", f"one {args.preset} step at a time"):
        return None
    cap, cap_note = choose_cap(args.cap_gib)
    settings = s3_settings(args)
    meta = {
        "command": args.command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": source_commit(),
        "machine": machine_line(),
        "cores": os.cpu_count(),
        "preset": args.preset,
        "repeat": args.repeat,
        "repeat_note": args.repeat_note,
        "cap": cap,
        "cap_note": cap_note,
        "part_bytes": settings["part_mb"] * MiB,
        "concurrency": settings["concurrency"],
    }
    result: dict = {"meta": meta, "rows": []}
    for rep in range(args.repeat):
        for target in TARGETS:
            result["rows"].append(run_row(args.preset, target, rep, args, cap))
            meta.update(available_gib=mem_available() / GiB, seconds=time.perf_counter() - started)
            meta["done"] = len(result["rows"]) == 2 * args.repeat
            if args.json:  # after every row: a run cut short still leaves its rows (--render reports them)
                Path(args.json).write_text(json.dumps(result, indent=1))
    return result


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset", default=BIG, help="the model (slimckpt_testing.verl_checkpoints.fsdp_checkpoint.PRESETS)"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="disk+s3 pairs of rows; the wall is their median (default 3)",
    )
    p.add_argument(
        "--repeat-note",
        default="",
        help="a sentence the report carries about the repeat count (e.g. why the big preset ran once)",
    )
    p.add_argument("--part-mb", type=int, default=0, help="SLIMCKPT_S3_PART_MB for the s3 rows (0: its default)")
    p.add_argument(
        "--concurrency", type=int, default=0, help="SLIMCKPT_S3_CONCURRENCY for the s3 rows (0: its default)"
    )
    p.add_argument(
        "--cap-gib", type=float, default=20.0, help="a row's process tree is killed past this summed RssAnon"
    )
    p.add_argument("--work", default=str(REPO / "bench_work"), help="scratch dir for the steps and the server")
    p.add_argument(
        "--out", default=str(REPO / "BENCHMARKS.md"), help="report whose section is (re)written; '' for none"
    )
    p.add_argument("--json", default=str(REPO / "docs" / "bench_s3_save.json"), help="raw results; '' for none")
    p.add_argument("--render", default=None, metavar="JSON", help="re-render --out from a --json file (no runs)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeat is None:
        args.repeat = 3
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    args.command = command(args, p)
    return args


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The command line of what was measured: the switches that change a run, not where it reports."""
    words = ["python -m scripts.bench.s3_save"]
    for flag in ("preset", "repeat", "part_mb", "concurrency", "cap_gib"):
        value, default = getattr(args, flag), parser.get_default(flag)
        if value != default and value:
            words.append(f"--{flag.replace('_', '-')} {value}")
    return " ".join(words)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        args.out = args.scratch
        worker(args)
        return 0
    if args.render:
        result = json.loads(Path(args.render).read_text())
        if args.repeat_note:
            result["meta"]["repeat_note"] = args.repeat_note
    else:
        result = measure(args)
        if not result:
            return 0
    section = render_section(result)
    if args.out:
        write_section(section, Path(args.out))
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
