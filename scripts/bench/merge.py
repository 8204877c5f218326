#!/usr/bin/env python
"""slimckpt benchmarks, measured side by side with verl 0.9.1 in the same run.

  make bench                               # all sizes, 3 repeats, writes BENCHMARKS.md + docs/*.png
  python -m scripts.bench.merge --sizes 0.25b --repeats 1 --out /tmp/b.md   # a quick look

Merge: FSDP2 checkpoints (world size 2, made by verl's own FSDPCheckpointManager) of Llama models
of about 0.25B, 0.5B and 1B parameters, merged to HF safetensors by `python -m verl.model_merger`
(verl's code, slimckpt disabled) and by `slimckpt merge`. For each: peak anonymous RSS of the
merging process (sampled from outside every 10 ms), wall time (median of --repeats runs, page
cache of the inputs dropped before every run), and the I/O floor: bytes read and written at the
disk bandwidth measured in the same run. slimckpt's runs also record where its writer's time went
(`SLIMCKPT_MERGE_STATS`, slimckpt.engine.writer_stats): casting (the reads are its page faults), the
last writes and the fsyncs.

verl's merger runs twice in every turn, back to back: "cold" (after the other tools' merges) and
"warm" (directly after a verl merge); slimckpt's speed-up is reported against both.

Writes BENCHMARKS.md's merge section and, when --out is the repo's BENCHMARKS.md, docs/merge.md's block
between `<!-- merge-bench:begin -->` and `<!-- merge-bench:end -->`; `--render JSON` rewrites both
from an earlier run's --json without measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from scripts.bench.merge_report import (
    CODE_PATHS,
    MOE_SIZES,
    NO_FSYNC,
    SIZES,
    VERL_COLD,
    VERL_WARM,
    MergeRow,
    commit_words,
    floor_ratio,  # noqa: F401  (scale.py imports it from here)
    is_verl,
    machine_line,
    render_report,
    summary_block,
)
from slimckpt.engine.writer_stats import STATS_ENV
from slimckpt.observe.diskspeed import fastest_of, measure_disk_speed
from slimckpt.observe.measure import evict_from_page_cache, median, run_measured

REPO = Path(__file__).resolve().parents[2]

# lazy imports: torch and matplotlib load where a run measures or plots; --render and the report logic stay light


def make_checkpoint(size: str, work: Path, world_size: int) -> tuple[Path, int]:
    """verl's FSDPCheckpointManager writes model shards of a random-init model; kept between runs."""
    out = work / f"ckpt_{size}_ws{world_size}"
    done = out / "DONE.json"
    if done.exists():
        return out / "actor", json.loads(done.read_text())["params"]
    shutil.rmtree(out, ignore_errors=True)
    model, preset, experts = MOE_SIZES.get(size, ("llama", size, 0))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world_size}",
        "-m",
        "slimckpt_testing.verl_checkpoints.fsdp_checkpoint",
        "--out",
        str(out / "actor"),
        "--model",
        model,
        "--size-preset",
        preset,
        "--steps",
        "0",
        "--save-contents",
        "model",
    ]
    if experts:
        cmd += ["--experts", str(experts)]
    print(f"[bench] building the {size} checkpoint: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    info = next(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{") and '"params"' in line)
    done.write_text(json.dumps(info))
    return out / "actor", info["params"]


def shard_files(ckpt: Path) -> list[str]:
    return sorted(str(p) for p in ckpt.glob("model_world_size_*_rank_*.pt"))


def verl_command(ckpt: Path, target: Path) -> list[str]:
    """verl 0.9.1's own merger (run it with SLIMCKPT_DISABLE=1)."""
    return [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp"] + _dirs(ckpt, target)


def slimckpt_command(ckpt: Path, target: Path, *extra: str) -> list[str]:
    """`slimckpt merge` over an existing target, with `extra` flags."""
    return [sys.executable, "-m", "slimckpt.cli", "merge", *_dirs(ckpt, target), "--overwrite", *extra]


def _dirs(ckpt: Path, target: Path) -> list[str]:
    return ["--local_dir", str(ckpt), "--target_dir", str(target)]


def merge_commands(ckpt: Path, target: Path) -> dict[str, tuple[list[str], dict]]:
    """In the order each turn runs them."""
    verl = (verl_command(ckpt, target), {"SLIMCKPT_DISABLE": "1"})
    ours = slimckpt_command(ckpt, target)
    return {
        VERL_COLD: verl,
        VERL_WARM: verl,  # the same command again, directly after the cold one
        "slimckpt": (ours, {}),
        # what durability costs: the same merge without fsync, as verl's merger writes (not the default)
        NO_FSYNC: (slimckpt_command(ckpt, target, "--no_fsync"), {}),
    }


# with the cycle collector off, as the `slimckpt` command runs (cli.entry)
IMPORTS = "import gc; gc.disable(); import torch, transformers.modeling_utils, torch.distributed.tensor"


def measure_imports(repeats: int = 5) -> float:
    """Median wall of starting Python and importing what the merge's commit waits for: torch and
    transformers' modeling code (they name the tensors and write the configs as verl does) and
    DTensor (torch's reader checks the shards' locations). (verl's package is not imported:
    `verl_leaves`.)"""
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", IMPORTS],
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "2"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        walls.append(time.perf_counter() - start)
    return median(walls)


# the 1-minute load average as each merge starts: the machine is shared, and other work slows every tool
LOADS: list[float] = []


def bench_merge(size: str, work: Path, repeats: int, warm_repeats: int | None = None) -> list[MergeRow]:
    """Rows without their I/O floor: `main` sets it from the run's disk measurements. verl's warm
    merge runs in the first `warm_repeats` turns only (None: every turn)."""
    ckpt, params = make_checkpoint(size, work, world_size=2)
    inputs = shard_files(ckpt)
    read_bytes = sum(os.path.getsize(p) for p in inputs)
    commands = merge_commands(ckpt, work / "merged")
    walls: dict[str, list[float]] = {tool: [] for tool in commands}
    peaks: dict[str, list[int]] = {tool: [] for tool in commands}
    stats: dict[str, list[dict]] = {tool: [] for tool in commands}
    stats_file = work / "writer_stats.json"
    written: dict[str, int] = {}
    # the tools take turns, run after run: a shared machine's CPU and disk speeds drift within minutes
    # (measured: BENCHMARKS.md, Figures quoted in the code),
    # and a slow minute should fall on every tool, not on one tool's block of runs
    for i in range(repeats):
        for tool, (cmd, env) in commands.items():
            if tool == VERL_WARM and warm_repeats is not None and i >= warm_repeats:
                continue
            target = work / "merged"
            shutil.rmtree(target, ignore_errors=True)
            shutil.rmtree(str(target) + ".partial", ignore_errors=True)
            os.sync()  # no run pays for the writeback of an earlier one's dirty pages (verl's merger leaves them)
            evict_from_page_cache(inputs)
            stats_file.unlink(missing_ok=True)
            if tool == "slimckpt":  # where its writer's time went: disk or CPU (a few perf_counter calls per chunk)
                env = {**env, STATS_ENV: str(stats_file)}
            LOADS.append(round(os.getloadavg()[0], 2))
            res = run_measured(cmd, env={**env, "OMP_NUM_THREADS": "2"})
            if stats_file.exists():
                stats[tool].append(json.loads(stats_file.read_text()))
            # verl's merger exits 1 after writing when the checkpoint has no tokenizer; judge by output.
            files = list(target.glob("*.safetensors"))
            if not files:
                raise SystemExit(
                    f"[bench] {tool} produced no safetensors (exit {res.returncode}):\n{res.output[-3000:]}"
                )
            written[tool] = sum(f.stat().st_size for f in files)
            walls[tool].append(res.wall_s)
            peaks[tool].append(res.physical_peak)  # a process tree: its processes' shared pages once
            print(
                f"[bench] merge {size} {tool} run {len(walls[tool])}/{repeats}: {res.wall_s:.1f} s, "
                f"peak anonymous {res.physical_peak / 2**20:.0f} MiB",
                flush=True,
            )
    rows = [
        MergeRow(
            size,
            params,
            tool,
            max(peaks[tool]),
            median(walls[tool]),
            walls[tool],
            read_bytes,
            written[tool],
            writer_stats=stats[tool],
        )
        for tool in commands
    ]
    stats_file.unlink(missing_ok=True)
    shutil.rmtree(work / "merged", ignore_errors=True)
    return rows


def plot_merge(rows: list[MergeRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [r for r in rows if r.size not in MOE_SIZES] or rows  # one family per line: the dense sizes
    # the default merges only (an older run's JSON may hold rows of switches removed since)
    for tool in dict.fromkeys(r.tool for r in rows if r.tool == "slimckpt" or is_verl(r.tool)):
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


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def source_commit() -> dict:
    """The commit the measured code is at, and whether the working tree changed it (None: no git)."""
    head = _git("rev-parse", "--short=7", "HEAD")
    dirty = _git("status", "--porcelain", "--", *CODE_PATHS)
    return {"commit": head, "dirty": bool(dirty) if dirty is not None else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated, from: " + ", ".join(SIZES))
    parser.add_argument("--repeats", type=int, default=3, help="runs per tool and size; the wall time is their median")
    parser.add_argument(
        "--verl-warm-repeats",
        type=int,
        default=3,
        metavar="N",
        help="verl's warm merge (directly after its cold one) in the first N turns only, at every "
        "size but the largest, which always gets --repeats (default 3: fewer of verl's runs at the "
        "small sizes keep a run of 5 repeats shorter)",
    )
    parser.add_argument(
        "--work", default=str(REPO / "bench_work"), help="scratch dir for checkpoints (kept between runs)"
    )
    parser.add_argument("--out", default=str(REPO / "BENCHMARKS.md"), help="markdown report to write")
    parser.add_argument(
        "--summary",
        default=None,
        metavar="PATH",
        help="document whose merge-bench block to rewrite (between the markers); default: the repo's "
        "docs/merge.md when --out is the repo's BENCHMARKS.md, else none; '' for none",
    )
    parser.add_argument("--plot", default=str(REPO / "docs" / "merge_peak_memory.png"), help="PNG plot to write")
    parser.add_argument("--json", default=None, help="also write raw results (and the disk speed) here")
    parser.add_argument(
        "--render",
        default=None,
        metavar="JSON",
        help="re-render the report, docs/merge.md's block and the plot from a --json file of an earlier "
        "run (no measuring)",
    )
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    if args.summary is None:
        args.summary = str(SUMMARY_DOC) if Path(args.out).resolve() == REPO / "BENCHMARKS.md" else ""
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        rows = [MergeRow(**r) for r in saved["rows"]]
        publish(rows, saved, args)
        return 0
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    meta = {
        "command": "python -m scripts.bench.merge " + " ".join(sys.argv[1:] if argv is None else argv),
        **source_commit(),
        "load_average_1min": {"start": os.getloadavg()[0]},
    }
    disks = [measure_disk_speed(str(work))]
    meta["machine"] = machine_line(disks[0])
    print(f"[bench] {meta['machine']}; {commit_words(meta)}; load {meta['load_average_1min']['start']:.2f}", flush=True)
    imports = [measure_imports()]
    print(f"[bench] python + {IMPORTS}: {imports[-1]:.2f} s (median of 5)", flush=True)
    rows: list[MergeRow] = []
    for k, size in enumerate(sizes):
        if k:  # the disk's speed drifts here: measured again next to each size's merges
            disks.append(measure_disk_speed(str(work)))
            imports.append(measure_imports())
            print(f"[bench] disk before {size}: {disks[-1].describe()}; imports {imports[-1]:.2f} s", flush=True)
        largest_dense = [d for d in sizes if d not in MOE_SIZES][-1:] or sizes[-1:]
        warm = None if size in (*largest_dense, *MOE_SIZES) else args.verl_warm_repeats
        rows += bench_merge(size, work, args.repeats, warm)
    disks.append(measure_disk_speed(str(work)))
    imports.append(measure_imports())
    print(f"[bench] disk at the end: {disks[-1].describe()}; imports {imports[-1]:.2f} s", flush=True)
    meta["load_average_1min"].update(end=os.getloadavg()[0], merges=list(LOADS))
    disk = fastest_of(disks)
    for r in rows:
        r.io_floor_s = disk.io_floor_s(r.read_bytes, r.written_bytes)
    meta.update(
        {
            "disk": asdict(disk),
            "disk_measurements": [asdict(d) for d in disks],
            "sizes": args.sizes,
            "repeats": args.repeats,
            "seconds": time.time() - started,
            "date": time.strftime("%Y-%m-%d"),
            "imports_s": min(imports),
        }
    )  # like the disk's speeds: the best this machine did in the run
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [asdict(r) for r in rows], **meta}, indent=1))
    print(publish(rows, meta, args))
    return 0


def publish(rows: list[MergeRow], meta: dict, args) -> str:
    """BENCHMARKS.md's merge section, docs/merge.md's block and the plot, from one run's rows and meta (its JSON)."""
    plot_merge(rows, Path(args.plot))
    report = render_report(rows, meta, args)
    write_keeping_save_section(Path(args.out), report)
    if args.summary:
        summary = Path(args.summary)
        if not write_summary_block(summary, summary_block(rows, meta)):
            print(f"[bench] {summary} has no {SUMMARY_BEGIN} ... {SUMMARY_END} block: left as it is", flush=True)
    return report


SUMMARY_BEGIN, SUMMARY_END = "<!-- merge-bench:begin -->", "<!-- merge-bench:end -->"
SUMMARY_DOC = REPO / "docs" / "merge.md"  # the merge's user doc; README quotes its headline by hand


def write_keeping_save_section(path: Path, report: str) -> None:
    """The merge report replaces the file, except every marked section (`<!-- NAME:begin -->` to
    `<!-- NAME:end -->`: the save, loop, scale and train-scale benchmarks', the hand-written
    `code-figures`), kept at the end in their order, so that the merge bench alone drops no other
    benchmark's results."""
    old = path.read_text() if path.exists() else ""
    kept = []
    for match in re.finditer(r"<!-- ([\w.-]+):begin -->.*?<!-- \1:end -->", old, flags=re.S):
        kept.append(match.group(0))
    for section in kept:
        report = report.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(report)


def write_summary_block(path: Path, block: str) -> bool:
    """Replace what lies between the merge-bench markers; False (and nothing written) without them."""
    old = path.read_text() if path.exists() else ""
    if SUMMARY_BEGIN not in old or SUMMARY_END not in old:
        return False
    before, rest = old.split(SUMMARY_BEGIN, 1)
    after = rest.split(SUMMARY_END, 1)[1]
    path.write_text(before + SUMMARY_BEGIN + "\n" + block.strip("\n") + "\n" + SUMMARY_END + after)
    return True


if __name__ == "__main__":
    sys.exit(main())
