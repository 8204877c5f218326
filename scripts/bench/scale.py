#!/usr/bin/env python
"""Scale benchmark: merging a Llama-3-8B-shaped verl checkpoint, slimckpt against verl 0.9.1's merger.

  make bench-scale                                    # 8B, world size 8, 3 runs per tool -> BENCHMARKS.md
  python -m scripts.bench.scale --preset 1b --world-size 4 --repeats 1 --out /tmp/s.md --readme ''   # a quick look
  python -m scripts.bench.scale --render docs/bench_scale.json      # re-render the section, no runs

The checkpoint (fp32, model only) is written by slimckpt_testing.verl_checkpoints.fake_pg_checkpoint: one rank at
a time over torch's fake process group, each rank's FSDP2 shards saved by verl's own
FSDPCheckpointManager, so no process ever holds the model. Then, in the same run:

  slimckpt merge, and torchrun --nproc_per_node 2 ... --distributed_merge: peak anonymous RSS
    (sampled from outside), wall, and wall over the I/O floor (bytes read / read bandwidth + bytes
    written / write bandwidth, the bandwidths measured in this run), --repeats runs each, turn by
    turn; each output checked tensor for tensor against the shards (slimckpt_testing.merge_check);
    the single merge's writer also reports where its time went (SLIMCKPT_MERGE_STATS).
  verl's merger (SLIMCKPT_DISABLE=1) under a memory cap: its process tree is killed when its
    anonymous RSS passes --verl-cap-gib, as the OOM killer would; the report says how far it got
    and what it would have needed, from verl's own peak per byte of shards on a smaller checkpoint
    (--ref-preset, same world size) merged without a cap in the same run.

The run needs --min-free-gib of free disk where --work is (the shards, one merge output, the smaller
checkpoint); without it it says so and exits 0. Everything it writes under --work is deleted at the end.
The section and README's row are rendered from the run's JSON by scripts/bench/scale_report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from scripts.bench.merge import slimckpt_command, source_commit, verl_command
from scripts.bench.save import machine_line, mem_available, write_section
from scripts.bench.scale_report import (
    DISTRIBUTED,
    FLOOR,
    GB,
    README_BEGIN,
    README_END,
    SINGLE,
    GiB,
    MiB,
    left_looks_incomplete,
    readme_block,
    refloor,
    render_section,
    rerun_recovers,
)
from slimckpt.engine.writer_stats import STATS_ENV
from slimckpt.observe.diskspeed import fastest_of, measure_disk_speed
from slimckpt.observe.measure import evict_from_page_cache, median, run_measured
from slimckpt.observe.memory import rss_anon_bytes

# lazy imports: psutil loads where a capped merge is watched

REPO = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "2", "SLIMCKPT_LOG_LEVEL": "WARNING"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--preset", default="llama3-8b", help="slimckpt_testing.verl_checkpoints.fsdp_checkpoint size preset"
    )
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="merges per slimckpt tool")
    p.add_argument("--workers", type=int, default=2, help="torchrun ranks of the distributed merge")
    p.add_argument(
        "--verl-cap-gib",
        type=float,
        default=18.0,
        help="anonymous RSS at which verl's merger is killed (lowered, and the report says so, when "
        "the host has less available)",
    )
    p.add_argument("--ref-preset", default="0.5b", help="the smaller checkpoint verl's merger runs on without a cap")
    p.add_argument(
        "--build-jobs",
        type=int,
        default=1,
        help="ranks the builder writes at once (each holds its rank's shards: 4 GB at 8B, world size 8)",
    )
    p.add_argument("--min-free-gib", type=float, default=50.0, help="free disk the run needs under --work")
    p.add_argument("--work", default=str(REPO / "bench_work" / "scale"))
    p.add_argument("--keep", action="store_true", help="keep the checkpoints under --work")
    p.add_argument("--json", default=str(REPO / "docs" / "bench_scale.json"))
    p.add_argument("--out", default=str(REPO / "BENCHMARKS.md"), help="report whose scale section to write")
    p.add_argument("--readme", default=str(REPO / "README.md"), help="README whose headline row to write; '' for none")
    p.add_argument("--render", default=None, metavar="JSON", help="re-render from an earlier run's JSON")
    p.add_argument(
        "--note",
        default=None,
        help="a paragraph under the section's targets, kept in the JSON (with --render: added to it)",
    )
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ running


def build(preset: str, world: int, out: Path, jobs: int = 1) -> dict:
    """The checkpoint, written by the fake-process-group builder; measured like the merges."""
    cmd = [
        sys.executable,
        "-m",
        "slimckpt_testing.verl_checkpoints.fake_pg_checkpoint",
        "--out",
        str(out),
        "--world-size",
        str(world),
        "--size-preset",
        preset,
        "--save-contents",
        "model",
        "--jobs",
        str(jobs),
    ]
    print(f"[bench-scale] building {preset} at world size {world}: {' '.join(cmd)}", flush=True)
    res = run_measured(cmd, env=ENV)
    if res.returncode != 0:
        raise SystemExit(f"[bench-scale] the builder failed (exit {res.returncode}):\n{res.output[-3000:]}")
    info = json.loads(next(ln for ln in res.output.splitlines() if ln.startswith("{") and '"params"' in ln))
    shards = shard_files(out)
    info.update(
        wall_s=res.wall_s,
        peak_rss_anon=res.max_peak,
        shard_bytes=sum(p.stat().st_size for p in shards),
        files=len(shards),
    )
    print(
        f"[bench-scale] built {info['params'] / 1e9:.2f}B params, {info['shard_bytes'] / GB:.1f} GB in "
        f"{len(shards)} rank files, {res.wall_s:.0f} s, builder peak {res.max_peak / GiB:.1f} GiB",
        flush=True,
    )
    return info


def shard_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("model_world_size_*_rank_*.pt"))


def merge_command(tool: str, ckpt: Path, target: Path, workers: int) -> list[str]:
    _, *merge = slimckpt_command(ckpt, target, "--no_progress")
    if tool != DISTRIBUTED:
        return [sys.executable, *merge]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={workers}",
        *merge,
        "--distributed_merge",
    ]


def clean(target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(str(target) + ".partial", ignore_errors=True)


def check_output(ckpt: Path, target: Path) -> dict:
    """slimckpt_testing.merge_check in its own process: every output tensor against the shards."""
    res = run_measured(
        [sys.executable, "-m", "slimckpt_testing.merge_check", "--shards", str(ckpt), "--merged", str(target)], env=ENV
    )
    line = next((ln for ln in res.output.splitlines() if ln.startswith("{")), "{}")
    found = json.loads(line)
    found.update(wall_s=res.wall_s, peak_rss_anon=res.max_peak, returncode=res.returncode)
    print(
        f"[bench-scale] checked {target.name}: ok={found.get('ok')} {found.get('tensors')} tensors, {res.wall_s:.0f} s",
        flush=True,
    )
    return found


def _new_row(tool: str) -> dict:
    return {
        "tool": tool,
        "walls": [],
        "peaks": [],
        "rank_peaks": [],
        "tree_peaks": [],
        "loads": [],
        "turns": [],
        "written_bytes": 0,
        "check": None,
    }


def merge_runs(ckpt: Path, work: Path, repeats: int, workers: int) -> dict[str, dict]:
    """The single and the distributed merge, taking turns run after run (a slow minute falls on both).
    The single merge also records where its writer's time went (slimckpt.engine.writer_stats)."""
    inputs = [str(p) for p in shard_files(ckpt)]
    rows = {t: _new_row(t) for t in (SINGLE, DISTRIBUTED)}
    rows[SINGLE]["writer_stats"] = []
    stats_file = work / "writer_stats.json"
    for i in range(repeats):
        for row in rows.values():
            tool = row["tool"]
            target = work / "merged"
            clean(target)
            os.sync()
            evict_from_page_cache(inputs)
            row["loads"].append(round(os.getloadavg()[0], 2))
            row["turns"].append(i)
            stats_file.unlink(missing_ok=True)
            env = {**ENV, STATS_ENV: str(stats_file)} if tool == SINGLE else ENV
            res = run_measured(merge_command(tool, ckpt, target, workers), env=env)
            files = list(target.glob("*.safetensors"))
            if res.returncode != 0 or not files:
                raise SystemExit(f"[bench-scale] {tool} failed (exit {res.returncode}):\n{res.output[-3000:]}")
            if tool == SINGLE and stats_file.exists():
                row["writer_stats"].append(json.loads(stats_file.read_text()))
            row["written_bytes"] = sum(f.stat().st_size for f in files)
            row["walls"].append(res.wall_s)
            # one process's merge: its process tree, shared pages once; torchrun's: each rank's
            # process tree apart from the launcher
            launcher = next(iter(res.peaks), None)  # the sampler sees the root first
            ranks = {pid: peak for pid, peak in res.peaks.items() if pid != launcher}
            row["peaks"].append(res.physical_peak if tool != DISTRIBUTED else max(ranks.values(), default=0))
            row["rank_peaks"].append(max(ranks.values(), default=0))
            row["tree_peaks"].append(res.physical_peak)
            print(
                f"[bench-scale] {tool} run {i + 1}/{repeats}: {res.wall_s:.1f} s, peak {row['peaks'][-1] / MiB:.0f} MiB"
                f" (load {row['loads'][-1]:.1f})",
                flush=True,
            )
            if i == repeats - 1:
                row["check"] = check_output(ckpt, target)
            clean(target)
    stats_file.unlink(missing_ok=True)
    return rows


def merge_as_typed(ckpt: Path, target: Path) -> list[str]:
    """`slimckpt merge` as a user types it again after a failure: no --overwrite."""
    return [sys.executable, "-m", "slimckpt.cli", "merge", "--local_dir", str(ckpt), "--target_dir", str(target)]


def verify_target(target: Path) -> dict:
    res = subprocess.run(
        [sys.executable, "-m", "slimckpt.cli", "verify", "--no_progress", str(target)],
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
    )
    said = (res.stdout + res.stderr).replace(str(target), "<target>").strip().splitlines()
    return {"returncode": res.returncode, "said": said[-1][:300] if said else ""}


def killed_midway(ckpt: Path, work: Path, at_s: float) -> dict:
    """`slimckpt merge` SIGKILLed `at_s` into its run, as a job killed mid-merge: what it left where
    its output goes, what `slimckpt verify` says of that, then the same command again over it."""
    target = work / "merged"
    partial = Path(f"{target}.partial")
    clean(target)
    os.sync()
    evict_from_page_cache([str(p) for p in shard_files(ckpt)])
    command = [*merge_as_typed(ckpt, target), "--no_progress"]
    killed = run_capped(command, ENV, cap=1 << 62, kill_after_s=at_s)
    left = sorted(p for p in partial.rglob("*") if p.is_file()) if partial.exists() else []
    found = {
        "kill_after_s": at_s,
        "killed": killed["killed"],
        "killed_at_s": killed["killed_at_s"],
        "returncode": killed["returncode"],
        "target_exists": target.exists(),
        "partial_files": len(left),
        "partial_bytes": sum(p.stat().st_size for p in left),
        "partial_manifest": (partial / "manifest.json").exists(),
        "verify_after_kill": verify_target(target),
    }
    again = run_measured(command, env=ENV)
    found.update(
        rerun_returncode=again.returncode,
        rerun_wall_s=again.wall_s,
        rerun_tail=again.output[-500:] if again.returncode else "",
        partial_after_rerun=partial.exists(),
        verify_after_rerun=verify_target(target),
    )
    clean(target)
    return found


def run_capped(
    cmd: list[str],
    env: dict,
    cap: int,
    interval_s: float = 0.02,
    timeline_s: float = 0.5,
    cwd: Path | None = None,
    kill_after_s: float | None = None,
) -> dict:
    """`cmd`, its process group killed (SIGKILL) once its tree's summed RssAnon passes `cap`, or once
    it has run `kill_after_s`. Returns wall, peak, whether, when and why it was killed, what it had
    read and printed by then, and the tree's RssAnon every `timeline_s` (seconds since `started_at`,
    a time.time())."""
    import psutil

    started_at, start = time.time(), time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=cwd,
    )
    chunks: list[bytes] = []
    # read1: what the pipe holds now, so a line printed long before a kill is read even when a
    # process outside the killed group keeps the pipe open past the join below
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read1(4096), b"")), daemon=True)
    reader.start()
    peak, killed_at, kill_reason, read_bytes, timeline = 0, None, None, 0, []
    root = psutil.Process(proc.pid)
    seen: dict[int, psutil.Process] = {}
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        seen.update((p.pid, p) for p in procs)
        now = sum(rss_anon_bytes(p.pid) for p in procs)
        peak = max(peak, now)
        try:
            read_bytes = max(read_bytes, sum(p.io_counters().read_chars for p in procs))
        except (psutil.Error, AttributeError):
            pass
        if not timeline or time.perf_counter() - start - timeline[-1][0] >= timeline_s:
            timeline.append((round(time.perf_counter() - start, 2), now))
        elapsed = time.perf_counter() - start
        if now > cap or (kill_after_s is not None and elapsed >= kill_after_s):
            killed_at, kill_reason = elapsed, "memory" if now > cap else "time"
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(interval_s)
    # torchrun starts its ranks in sessions of their own: the group kill misses them, and a rank whose
    # launcher is gone can wait on its store for half an hour
    for p in seen.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    proc.wait()
    reader.join(timeout=10)
    output = b"".join(chunks).decode(errors="replace")
    loaded = re.findall(r"Loading (\d+) FSDP shards:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)", output)
    return {
        "wall_s": time.perf_counter() - start,
        "peak_rss_anon": peak,
        "killed": killed_at is not None,
        "killed_at_s": killed_at,
        "kill_reason": kill_reason,
        "returncode": proc.returncode,
        "read_bytes": read_bytes,
        "shards_loaded": int(loaded[-1][1]) if loaded else 0,
        "output": output,
        "output_tail": output[-1500:],
        "started_at": started_at,
        "timeline": timeline,
    }


def verl_reference(preset: str, world: int, work: Path, jobs: int = 1) -> dict:
    """verl's merger without a cap on a smaller checkpoint of the same world size: its peak per byte of shards."""
    ckpt = work / f"ref_{preset}_ws{world}" / "actor"
    info = build(preset, world, ckpt, jobs)
    target = work / "ref_merged"
    clean(target)
    os.sync()
    evict_from_page_cache([str(p) for p in shard_files(ckpt)])
    res = run_measured(verl_command(ckpt, target), env={**ENV, "SLIMCKPT_DISABLE": "1"})
    files = list(target.glob("*.safetensors"))
    if not files:
        raise SystemExit(
            f"[bench-scale] verl's merger wrote nothing on {ckpt} (exit {res.returncode}):\n{res.output[-3000:]}"
        )
    row = {
        "preset": preset,
        "params": info["params"],
        "shard_bytes": info["shard_bytes"],
        "wall_s": res.wall_s,
        "peak_rss_anon": res.max_peak,
        "per_shard_byte": res.max_peak / info["shard_bytes"],
    }
    print(
        f"[bench-scale] verl's merger on {preset}: {res.wall_s:.1f} s, peak {res.max_peak / GiB:.2f} GiB = "
        f"{row['per_shard_byte']:.2f}x its {info['shard_bytes'] / GB:.1f} GB of shards",
        flush=True,
    )
    clean(target)
    shutil.rmtree(ckpt.parent, ignore_errors=True)
    return row


def enough_disk(work: Path, need_gib: float, tag: str, what: str) -> bool:
    """Whether `work` has `need_gib` free; if not, one line saying so (nothing is measured then)."""
    free = shutil.disk_usage(work).free
    if free >= need_gib * GiB:
        return True
    print(
        f"[{tag}] {work} has {free / GiB:.0f} GiB free; the run needs {need_gib:g} GiB ({what}): nothing "
        f"measured. Free disk there, or pass --work on a larger disk.",
        flush=True,
    )
    return False


def choose_cap(requested_gib: float) -> tuple[int, str]:
    """The cap, lowered below what the host has available (other work shares it) so that the kill is
    ours, not the kernel's; and why, when lowered."""
    cap = int(requested_gib * GiB)
    avail = mem_available()
    room = avail - 2 * GiB
    if room < cap:
        return room, (
            f"lowered from {requested_gib:g} GiB: the host had {avail / GiB:.1f} GiB available when the run started"
        )
    return cap, ""


def measure(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not enough_disk(
        work, args.min_free_gib, "bench-scale", f"the {args.preset} shards, one merge output, a smaller checkpoint"
    ):
        return {}
    free = shutil.disk_usage(work).free
    started = time.time()
    cap, cap_note = choose_cap(args.verl_cap_gib)
    meta = {
        "command": " ".join(["python -m scripts.bench.scale", *sys.argv[1:]]),
        **source_commit(),
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "world_size": args.world_size,
        "repeats": args.repeats,
        "workers": args.workers,
        "free_disk_gib": free / GiB,
        "mem_available_gib": mem_available() / GiB,
        "verl_cap": cap,
        "verl_cap_requested_gib": args.verl_cap_gib,
        "verl_cap_note": cap_note,
        "load_start": os.getloadavg()[0],
    }
    print(
        f"[bench-scale] {free / GiB:.0f} GiB free disk, {meta['mem_available_gib']:.1f} GiB available memory, "
        f"verl cap {cap / GiB:.1f} GiB {cap_note}",
        flush=True,
    )
    try:
        reference = verl_reference(args.ref_preset, args.world_size, work, args.build_jobs)
        ckpt = work / f"ckpt_{args.preset}_ws{args.world_size}" / "actor"
        built = build(args.preset, args.world_size, ckpt, args.build_jobs)
        disks = [measure_disk_speed(str(work))]
        print(f"[bench-scale] disk: {disks[-1].describe()}", flush=True)
        rows = merge_runs(ckpt, work, args.repeats, args.workers)
        midway = killed_midway(ckpt, work, median(rows[SINGLE]["walls"]) / 2)
        print(
            f"[bench-scale] merge killed at {midway['killed_at_s'] or 0:.0f} s: left incomplete "
            f"{left_looks_incomplete(midway)}, merged again {rerun_recovers(midway)}",
            flush=True,
        )
        disks.append(measure_disk_speed(str(work)))
        print(f"[bench-scale] disk: {disks[-1].describe()}", flush=True)
        target = work / "verl_merged"
        clean(target)
        os.sync()
        evict_from_page_cache([str(p) for p in shard_files(ckpt)])
        print(f"[bench-scale] verl's merger under a {cap / GiB:.1f} GiB cap", flush=True)
        verl = run_capped(verl_command(ckpt, target), {**ENV, "SLIMCKPT_DISABLE": "1"}, cap)
        del verl["output"]  # its tail is kept; the whole of tqdm's output does not belong in the JSON
        verl["wrote_bytes"] = sum(f.stat().st_size for f in target.glob("*.safetensors")) if target.exists() else 0
        clean(target)
        print(
            f"[bench-scale] verl: killed={verl['killed']} at {verl['killed_at_s'] or verl['wall_s']:.0f} s, peak "
            f"{verl['peak_rss_anon'] / GiB:.1f} GiB, {verl['shards_loaded']} shards loaded",
            flush=True,
        )
        disks.append(measure_disk_speed(str(work)))
    finally:
        if not args.keep:
            for child in work.glob("*"):
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
    for row in rows.values():
        row["read_bytes"] = built["shard_bytes"]
    meta.update(
        seconds=time.time() - started,
        load_end=os.getloadavg()[0],
        disk=asdict(fastest_of(disks)),
        disk_measurements=[asdict(d) for d in disks],
    )
    return refloor(
        {
            **meta,
            "build": built,
            "rows": list(rows.values()),
            "verl": verl,
            "verl_reference": reference,
            "killed_midway": midway,
        }
    )


def publish(result: dict, args: argparse.Namespace) -> None:
    section = render_section(result)
    write_section(section, Path(args.out))
    block = readme_block(result)
    if args.readme and block is None:
        print(
            f"[bench-scale] {result['build']['params'] / 1e9:.2f}B is below README's headline size: README left "
            f"as it is",
            flush=True,
        )
    elif args.readme:
        readme = Path(args.readme)
        text = readme.read_text()
        if README_BEGIN in text and README_END in text:
            write_section(block + "\n", readme)
        else:
            print(f"[bench-scale] {readme} has no {README_BEGIN} ... {README_END} block: left as it is", flush=True)
    print(section)


def _terminated(*_) -> None:
    """A timeout's SIGTERM: the tool running now goes first (it would write on into the deleted
    dirs), then measure's `finally` deletes what the run wrote."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    sys.exit(143)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        changed = result.get("floor") != FLOOR or args.note is not None
        refloor(result)
        if args.note is not None:
            result["note"] = args.note
        if changed:
            Path(args.render).write_text(json.dumps(result, indent=1))
        publish(result, args)
        return 0
    result = measure(args)
    if not result:
        return 0
    result["machine"] = machine_line()
    if args.note:
        result["note"] = args.note
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    publish(result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
