#!/usr/bin/env python
"""slimckpt benchmarks, measured side by side with verl 0.9.1 in the same run.

  make bench                               # all sizes, 3 repeats, writes BENCHMARKS.md + docs/*.png
  python scripts/bench.py --sizes 0.25b --repeats 1 --out /tmp/b.md   # a quick look

Merge: FSDP2 checkpoints (world size 2, made by verl's own FSDPCheckpointManager) of Llama models
of about 0.25B, 0.5B and 1B parameters, merged to HF safetensors by `python -m verl.model_merger`
(verl's code, slimckpt disabled) and by `slimckpt merge`. For each: peak anonymous RSS of the
merging process (sampled from outside every 10 ms), wall time (median of --repeats runs, page
cache of the inputs dropped before every run), and the I/O floor: bytes read and written at the
disk bandwidth measured in the same run. slimckpt's runs also record where its writer's time went
(`SLIMCKPT_MERGE_STATS`, slimckpt.write.writer_stats): reading, waiting for a buffer, casting.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slimckpt.observe.diskspeed import DiskSpeed, fastest_of, measure_disk_speed
from slimckpt.observe.measure import evict_from_page_cache, median, run_measured
from slimckpt.write.writer_stats import STATS_ENV, WriterStats

REPO = Path(__file__).resolve().parent.parent

# Presets of the checkpoint builder (Llama, untied embeddings, vocab 32000): about 0.25B, 0.5B, 1B parameters.
from slimckpt.testing.fsdp_checkpoint import PRESETS  # noqa: E402

SIZES = ("0.25b", "0.5b", "1b")


@dataclass
class MergeRow:
    size: str
    params: int
    tool: str
    peak_rss_anon: int
    wall_s: float
    walls: list
    read_bytes: int
    written_bytes: int
    io_floor_s: float = 0.0  # set once the run's disk measurements are in
    writer_stats: list = field(default_factory=list)  # slimckpt's forked writer, per run (writer_stats.WriterStats)


def make_checkpoint(size: str, work: Path, world_size: int) -> tuple[Path, int]:
    """verl's FSDPCheckpointManager writes model shards of a random-init model; kept between runs."""
    out = work / f"ckpt_{size}_ws{world_size}"
    done = out / "DONE.json"
    if done.exists():
        return out / "actor", json.loads(done.read_text())["params"]
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
           "-m", "slimckpt.testing.fsdp_checkpoint", "--out", str(out / "actor"), "--model", "llama",
           "--size-preset", size, "--steps", "0", "--save-contents", "model"]
    print(f"[bench] building the {size} checkpoint: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    info = next(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{") and '"params"' in line)
    done.write_text(json.dumps(info))
    return out / "actor", info["params"]


def shard_files(ckpt: Path) -> list[str]:
    return sorted(str(p) for p in ckpt.glob("model_world_size_*_rank_*.pt"))


NO_FSYNC = "slimckpt --no_fsync"
PAGE_CACHE = "slimckpt, page cache"
NO_EARLY = "slimckpt, no early write"


def merge_commands(ckpt: Path, target: Path) -> dict[str, tuple[list[str], dict]]:
    return {
        "verl 0.9.1": ([sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                        "--local_dir", str(ckpt), "--target_dir", str(target)], {"SLIMCKPT_DISABLE": "1"}),
        "slimckpt": ([sys.executable, "-m", "slimckpt.cli", "merge", "--local_dir", str(ckpt),
                      "--target_dir", str(target), "--overwrite"], {}),
        # what durability costs: the same merge without fsync, as verl's merger writes (not the default)
        NO_FSYNC: ([sys.executable, "-m", "slimckpt.cli", "merge", "--local_dir", str(ckpt),
                    "--target_dir", str(target), "--overwrite", "--no_fsync"], {}),
        # what O_DIRECT buys: the default merge through the page cache, as verl's merger reads and writes
        PAGE_CACHE: ([sys.executable, "-m", "slimckpt.cli", "merge", "--local_dir", str(ckpt),
                      "--target_dir", str(target), "--overwrite"], {"SLIMCKPT_DIRECT_IO": "0"}),
        # what the torch-free early write earns (slimckpt.merge.early_write): the merge on the torch path alone
        NO_EARLY: ([sys.executable, "-m", "slimckpt.cli", "merge", "--local_dir", str(ckpt),
                    "--target_dir", str(target), "--overwrite"], {"SLIMCKPT_MERGE_GUESS": "0"}),
    }


# with the cycle collector off, as the `slimckpt` command runs (cli.entry)
IMPORTS = "import gc; gc.disable(); import torch, transformers.modeling_utils, torch.distributed.tensor"


def measure_imports(repeats: int = 5) -> float:
    """Median wall of starting Python and importing what the merge's commit waits for: torch and
    transformers' modeling code (they name the tensors and write the configs as verl does) and
    DTensor (torch's reader checks the shards' locations). The weights themselves are written
    meanwhile, by a child forked before torch. (verl's package is not imported: `verl_leaves`.)"""
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", IMPORTS], check=True, env={**os.environ, "OMP_NUM_THREADS": "2"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
    return median(walls)


def bench_merge(size: str, work: Path, repeats: int) -> list[MergeRow]:
    """Rows without their I/O floor: `main` sets it from the run's disk measurements."""
    ckpt, params = make_checkpoint(size, work, world_size=2)
    inputs = shard_files(ckpt)
    read_bytes = sum(os.path.getsize(p) for p in inputs)
    commands = merge_commands(ckpt, work / "merged")
    walls: dict[str, list[float]] = {tool: [] for tool in commands}
    peaks: dict[str, list[int]] = {tool: [] for tool in commands}
    stats: dict[str, list[dict]] = {tool: [] for tool in commands}
    stats_file = work / "writer_stats.json"
    written: dict[str, int] = {}
    # the tools take turns, run after run: this VM's CPU and disk speeds drift by 1.5x within minutes,
    # and a slow minute should fall on every tool, not on one tool's block of runs
    for i in range(repeats):
        for tool, (cmd, env) in commands.items():
            target = work / "merged"
            shutil.rmtree(target, ignore_errors=True)
            shutil.rmtree(str(target) + ".partial", ignore_errors=True)
            os.sync()  # no run pays for the writeback of an earlier one's dirty pages (verl's merger leaves them)
            evict_from_page_cache(inputs)
            stats_file.unlink(missing_ok=True)
            if tool == "slimckpt":  # where its writer's time went: disk or CPU (a few perf_counter calls per chunk)
                env = {**env, STATS_ENV: str(stats_file)}
            res = run_measured(cmd, env={**env, "OMP_NUM_THREADS": "2"})
            if stats_file.exists():
                stats[tool].append(json.loads(stats_file.read_text()))
            # verl's merger exits 1 after writing when the checkpoint has no tokenizer; judge by output.
            files = list(target.glob("*.safetensors"))
            if not files:
                raise SystemExit(f"[bench] {tool} produced no safetensors (exit {res.returncode}):\n{res.output[-3000:]}")
            written[tool] = sum(f.stat().st_size for f in files)
            walls[tool].append(res.wall_s)
            peaks[tool].append(res.physical_peak)  # slimckpt's forked writer: parent + child, shared pages once
            print(f"[bench] merge {size} {tool} run {i + 1}/{repeats}: {res.wall_s:.1f} s, "
                  f"peak anonymous {res.physical_peak / 2**20:.0f} MiB", flush=True)
    rows = [MergeRow(size, params, tool, max(peaks[tool]), median(walls[tool]), walls[tool], read_bytes, written[tool],
                     writer_stats=stats[tool]) for tool in commands]
    stats_file.unlink(missing_ok=True)
    shutil.rmtree(work / "merged", ignore_errors=True)
    return rows


def plot_merge(rows: list[MergeRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for tool in dict.fromkeys(r.tool for r in rows if r.tool not in (NO_FSYNC, PAGE_CACHE, NO_EARLY)):  # ~ slimckpt's
        pts = sorted((r.params / 1e9, r.peak_rss_anon / 2**30) for r in rows if r.tool == tool)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=tool)
    ax.set_xlabel("model parameters (billions)")
    ax.set_ylabel("peak anonymous RSS (GiB)")
    ax.set_title("Merging an FSDP2 checkpoint (world size 2) to HF safetensors")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def merge_table(rows: list[MergeRow]) -> str:
    lines = ["| model | params | tool | peak RssAnon | wall (median) | I/O floor | wall / floor | RSS vs verl | speed-up vs verl |",
             "|---|---|---|---|---|---|---|---|---|"]
    for size in dict.fromkeys(r.size for r in rows):
        group = [r for r in rows if r.size == size]
        base = next(r for r in group if r.tool.startswith("verl"))
        for r in group:
            lines.append(
                f"| {size} | {r.params / 1e9:.2f}B | {r.tool} | {r.peak_rss_anon / 2**20:,.0f} MiB | {r.wall_s:.1f} s "
                f"| {r.io_floor_s:.1f} s | {r.wall_s / r.io_floor_s:.2f}x "
                + ("| - | - |" if r is base else
                   f"| {base.peak_rss_anon / r.peak_rss_anon:.1f}x lower | {base.wall_s / r.wall_s:.2f}x |")
            )
    return "\n".join(lines)


def largest_output_tensor_bytes(size: str) -> int:
    layers, hidden, intermediate, vocab, heads, kv_heads = PRESETS[size]
    return 2 * max(vocab * hidden, intermediate * hidden)  # bf16: embedding/lm_head or an MLP matrix


def _down(x: float) -> str:
    """Two decimals, rounded toward failing an at-least target (2.996 is 2.99, not 3.00)."""
    return f"{math.floor(x * 100) / 100:.2f}"


def _up(x: float) -> str:
    """Two decimals, rounded toward failing an at-most target (1.2004 is 1.21, not 1.20)."""
    return f"{math.ceil(x * 100) / 100:.2f}"


def targets(rows: list[MergeRow], disk=None, imports_s: float | None = None, disks: list | None = None) -> str:
    """The intermediate tier's targets, checked on the largest model of the run."""
    largest = max(rows, key=lambda r: r.params).size
    ours = next(r for r in rows if r.size == largest and r.tool == "slimckpt")
    verl = next(r for r in rows if r.size == largest and r.tool.startswith("verl"))
    budget = largest_output_tensor_bytes(largest) + 256 * 2**20
    fast = next((r for r in rows if r.size == largest and r.tool == NO_FSYNC), None)
    late = next((r for r in rows if r.size == largest and r.tool == NO_EARLY), None)
    mine = sorted((r.params, r.peak_rss_anon) for r in rows if r.tool == "slimckpt")
    theirs = sorted((r.params, r.peak_rss_anon) for r in rows if r.tool.startswith("verl"))
    checks = [
        (f"peak RssAnon at least 10x lower than verl's ({largest})", verl.peak_rss_anon / ours.peak_rss_anon >= 10,
         f"{verl.peak_rss_anon / ours.peak_rss_anon:.1f}x"),
        (f"peak RssAnon at most the largest output tensor + 256 MiB ({budget / 2**20:.0f} MiB)",
         ours.peak_rss_anon <= budget, f"{ours.peak_rss_anon / 2**20:.0f} MiB"),
        ("our peak roughly flat across sizes (largest / smallest <= 1.2)", mine[-1][1] / mine[0][1] <= 1.2,
         f"{_up(mine[-1][1] / mine[0][1])}"),
        ("verl's peak grows with the model", theirs[-1][1] > 1.5 * theirs[0][1], f"{theirs[-1][1] / theirs[0][1]:.2f}x"),
        (f"wall at least 3x faster than verl ({largest})", verl.wall_s / ours.wall_s >= 3,
         f"{_down(verl.wall_s / ours.wall_s)}x"),
        (f"wall within 1.5x of the I/O floor ({largest})", ours.wall_s / ours.io_floor_s <= 1.5,
         f"{_up(ours.wall_s / ours.io_floor_s)}x"),
    ]
    lines = ["| target | met | measured |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if ok else '**no**'} | {value} |" for name, ok, value in checks]
    goal = verl.wall_s / 3
    if imports_s is not None and goal < imports_s <= ours.wall_s:
        lines += ["", f"3x faster than verl would be {goal:.1f} s at {largest}. Starting Python and importing what "
                      f"the commit waits for (torch and transformers' modeling code, which name the "
                      f"tensors and write the config files as verl does) took {imports_s:.1f} s at best in this run, "
                      f"before any merge work."]
    smallest = min((r for r in rows if r.tool == "slimckpt"), key=lambda r: r.params)
    lines += _floor_analysis(ours, disks or ([disk] if disk is not None else []), imports_s,
                             smallest if smallest is not ours else None)
    if fast is not None:
        lines += ["", f"Without fsync (`--no_fsync`, not crash-safe) it takes {fast.wall_s:.1f} s: fsync is not what "
                      f"bounds it. Through the page cache instead of O_DIRECT (`SLIMCKPT_DIRECT_IO=0`): see the rows above."]
    if late is not None:
        lines += ["", f"Without the early write (`SLIMCKPT_MERGE_GUESS=0`: nothing is written before torch and "
                      f"transformers are imported and the real plan is made) it takes {late.wall_s:.1f} s "
                      f"(runs {min(late.walls):.1f}-{max(late.walls):.1f} s) and peaks at "
                      f"{late.peak_rss_anon / 2**20:.0f} MiB: the early write earns "
                      f"{late.wall_s - ours.wall_s:.1f} s at {largest} for "
                      f"{(ours.peak_rss_anon - late.peak_rss_anon) / 2**20:.0f} MiB."]
    return "\n".join(lines)


def _floor_analysis(ours: MergeRow, disks: list, imports_s: float | None,
                    smallest: MergeRow | None = None) -> list[str]:
    """What the run says about the wall/floor ratio: how much the runs spread, what the disk does
    when a merge reads and writes at once, and the floor at the run's typical disk speed."""
    if not disks:
        return []
    gb, moved = 1e9, ours.read_bytes + ours.written_bytes
    walls = sorted(ours.walls) or [ours.wall_s]
    lines = ["", f"slimckpt's {len(walls)} runs at {ours.size} took {walls[0]:.1f}-{walls[-1]:.1f} s "
                 f"({_up(walls[0] / ours.io_floor_s)}-{_up(walls[-1] / ours.io_floor_s)}x the floor). "
                 f"The floor adds the best isolated read and write times of the run."]
    mixed = sorted(d.mixed_bytes_per_s for d in disks if getattr(d, "mixed_bytes_per_s", 0))
    if mixed:
        lines[-1] += (f" A merge reads and writes at once, which this disk served at {mixed[0] / gb:.2f}-"
                      f"{mixed[-1] / gb:.2f} GB/s combined in the run's {len(mixed)} measurements: "
                      f"{moved / mixed[-1]:.1f}-{moved / mixed[0]:.1f} s for these bytes, against the "
                      f"{1.5 * ours.io_floor_s:.1f} s that 1.5x the floor allows. slimckpt's median moved them at "
                      f"{moved / ours.wall_s / gb:.2f} GB/s, Python's start and the commit included.")
    if len(disks) > 1:
        typical = DiskSpeed(median([d.write_bytes_per_s for d in disks]), median([d.read_bytes_per_s for d in disks]),
                            disks[0].size_bytes)
        typical_floor = typical.io_floor_s(ours.read_bytes, ours.written_bytes)
        lines[-1] += (f" With the median of the run's disk measurements instead of the best, the floor would be "
                      f"{typical_floor:.1f} s and the median wall {_up(ours.wall_s / typical_floor)}x it "
                      f"(for information; the target is judged on the best).")
    lines += _writer_analysis(ours)
    if imports_s and smallest is not None:
        lines += ["", f"Starting Python and importing torch and transformers took {imports_s:.1f} s at best in this "
                      f"run. slimckpt's writer, a child forked before those imports, reads and writes meanwhile; "
                      f"the commit waits for both. The smallest model's merge ({smallest.size}, its bytes "
                      f"{smallest.io_floor_s:.1f} s at the floor) took {smallest.wall_s:.1f} s."]
    return lines


def _writer_analysis(ours: MergeRow) -> list[str]:
    """What bounded slimckpt's writer in this run: its reads (the disk) or its casts (the CPU)."""
    runs = [WriterStats(**d) for d in ours.writer_stats]
    runs = [r for r in runs if r.wall_s > 0 and r.read_s > 0]
    if not runs:
        return []

    def span(values: list[float], fmt: str) -> str:
        lo, hi = min(values), max(values)
        return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}-{format(hi, fmt)}"

    busy = [100 * r.read_busy() for r in runs]
    return ["", f"Where slimckpt's writer (the child forked before the imports) spent its time, in {len(runs)} of "
                f"these runs: it took {span([r.wall_s for r in runs], '.1f')} s, and its read thread was inside "
                f"`preadv` for {span(busy, '.0f')}% of that, waiting {max(r.wait_buffer_s for r in runs):.2f} s at "
                f"most for the cast to hand a buffer back. Its reads moved "
                f"{span([r.read_bytes / r.read_s / 1e9 for r in runs], '.2f')} GB/s while the writes went on; "
                f"the casts took {span([r.cast_s for r in runs], '.1f')} s. "
                + ("The disk's reads, not the CPU, bound the merge." if min(busy) >= 90 else
                   "The read thread was idle part of the time: the cast or the writes held it back.")]


def machine_line(disk) -> str:
    import torch

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, torch {torch.__version__}; "
            f"disk measured in this run: {disk.describe()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated, from: " + ", ".join(SIZES))
    parser.add_argument("--repeats", type=int, default=3, help="runs per tool and size; the wall time is their median")
    parser.add_argument("--work", default=str(REPO / "bench_work"), help="scratch dir for checkpoints (kept between runs)")
    parser.add_argument("--out", default=str(REPO / "BENCHMARKS.md"), help="markdown report to write")
    parser.add_argument("--plot", default=str(REPO / "docs" / "merge_peak_memory.png"), help="PNG plot to write")
    parser.add_argument("--json", default=None, help="also write raw results (and the disk speed) here")
    parser.add_argument("--render", default=None, metavar="JSON",
                        help="re-render the report and plot from a --json file of an earlier run (no measuring)")
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        rows = [MergeRow(**r) for r in saved["rows"]]
        disk = DiskSpeed(**saved["disk"])
        args.sizes, args.repeats = saved["sizes"], saved["repeats"]
        plot_merge(rows, Path(args.plot))
        write_keeping_save_section(Path(args.out), render_report(rows, disk, args, saved["seconds"], saved["date"],
                                                                 saved.get("imports_s"),
                                                                 [DiskSpeed(**d) for d in saved.get("disk_measurements", [])]))
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    disks = [measure_disk_speed(str(work))]
    print(f"[bench] {machine_line(disks[0])}", flush=True)
    imports = [measure_imports()]
    print(f"[bench] python + {IMPORTS}: {imports[-1]:.2f} s (median of 5)", flush=True)
    rows: list[MergeRow] = []
    for k, size in enumerate(sizes):
        if k:  # the disk's speed drifts here: measured again next to each size's merges
            disks.append(measure_disk_speed(str(work)))
            imports.append(measure_imports())
            print(f"[bench] disk before {size}: {disks[-1].describe()}; imports {imports[-1]:.2f} s", flush=True)
        rows += bench_merge(size, work, args.repeats)
    disks.append(measure_disk_speed(str(work)))
    imports.append(measure_imports())
    print(f"[bench] disk at the end: {disks[-1].describe()}; imports {imports[-1]:.2f} s", flush=True)
    imports_s = min(imports)  # like the disk's speeds: the best this machine did in the run
    disk = fastest_of(disks)
    for r in rows:
        r.io_floor_s = disk.io_floor_s(r.read_bytes, r.written_bytes)
    plot_merge(rows, Path(args.plot))
    seconds, date = time.time() - started, time.strftime("%Y-%m-%d")
    report = render_report(rows, disk, args, seconds, date, imports_s, disks)
    write_keeping_save_section(Path(args.out), report)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [asdict(r) for r in rows], "disk": asdict(disk),
                                               "disk_measurements": [asdict(d) for d in disks], "sizes": args.sizes,
                                               "repeats": args.repeats, "seconds": seconds, "date": date,
                                               "imports_s": imports_s}, indent=1))
    print(report)
    return 0


SAVE_BEGIN, SAVE_END = "<!-- save-bench:begin -->", "<!-- save-bench:end -->"


def write_keeping_save_section(path: Path, report: str) -> None:
    """The merge report replaces the file, except scripts/bench_save.py's marked section, kept at
    the end (so `bench.py` alone does not drop the save results)."""
    old = path.read_text() if path.exists() else ""
    if SAVE_BEGIN in old and SAVE_END in old:
        section = SAVE_BEGIN + old.split(SAVE_BEGIN, 1)[1].split(SAVE_END, 1)[0] + SAVE_END
        report = report.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(report)


def _imports_words(imports_s: float | None) -> str:
    if imports_s is None:
        return "not measured in this run"
    return (f"{imports_s:.1f} s with Python's start at best in this run, measured at the start, before each "
            f"size and at the end, as the disk is")


def render_report(rows: list[MergeRow], disk, args, seconds: float, date: str, imports_s: float | None = None,
                  disks: list | None = None) -> str:
    plot_rel = os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.out)))
    return f"""# Benchmarks

Produced by `make bench` (`python scripts/bench.py --sizes {args.sizes} --repeats {args.repeats}`) on
{date}, in {seconds / 60:.1f} minutes. Machine: {machine_line(disk)} (fastest of the run's measurements).
verl 0.9.1 and slimckpt are measured in the same run, on the same checkpoint files.

## Merge: FSDP2 checkpoint (world size 2) to Hugging Face safetensors (bf16)

Checkpoints are written by verl's own `FSDPCheckpointManager` (model shards, fp32). verl:
`python -m verl.model_merger merge --backend fsdp` with `SLIMCKPT_DISABLE=1`; slimckpt: `slimckpt merge`.
Peak RssAnon is the peak anonymous memory of the merge, sampled from outside (largest over the
runs): the process's RssAnon every 10 ms; for slimckpt, whose writer runs in a forked child, also
the sum of parent's and child's Pss_Anon every 50 ms (pages they share counted once; summing their
RssAnon would count them twice), and the larger of the two is reported. Wall is the median of
{args.repeats} runs with the input pages evicted from the page cache before each run; the tools take
turns run after run, so a slow minute of the VM falls on all of them. (verl's merger is slower in that
order than in a block of its own runs: on this VM a 1B verl merge that directly followed another one
took 13.4-16.6 s, and one after slimckpt merges, or the first of a block, 21-24 s, in runs on
2026-11-30; the turns measure every verl run the second way.) I/O floor =
bytes read / read bandwidth + bytes written / write bandwidth, with the bandwidths measured in this
run at the start, before each model size and at the end (`slimckpt.observe.diskspeed`: 1 GiB written and
fsync'ed, then read cold, through the page cache and with O_DIRECT in 1 and 16 MiB requests,
medians of 3); each is the
fastest over those measurements and the two paths, i.e. the best this disk did in the run (its
speed drifts by up to 1.5x within minutes here).

{merge_table(rows)}

![peak memory vs model size]({plot_rel})

### Targets (intermediate tier)

{targets(rows, disk, imports_s, disks)}

Wall times are whole processes, Python and library imports included (both tools import torch and
transformers, verl's merger verl too). slimckpt's imports: {_imports_words(imports_s)}; its writer,
forked before torch is imported, reads and writes meanwhile.
slimckpt fsyncs every file it writes and verl's merger does not. slimckpt reads the shards and
writes the output with O_DIRECT where the filesystem allows it (`slimckpt.read.direct_io`);
`SLIMCKPT_DIRECT_IO=0` goes through the page cache instead.
"""


if __name__ == "__main__":
    sys.exit(main())
