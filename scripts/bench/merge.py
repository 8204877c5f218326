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
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slimckpt.engine.writer_stats import STATS_ENV, WriterStats
from slimckpt.observe.diskspeed import DiskSpeed, fastest_of, measure_disk_speed
from slimckpt.observe.measure import evict_from_page_cache, median, run_measured

REPO = Path(__file__).resolve().parents[2]

# Presets of the checkpoint builder (Llama, untied embeddings, vocab 32000): about 0.25B, 0.5B, 1B parameters.
from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import PRESETS  # noqa: E402

# lazy imports: torch and matplotlib load where a run measures or plots; --render and the report logic stay light

DENSE_SIZES = ("0.25b", "0.5b", "1b")
# mixture-of-experts rows: {size: (family, dims preset, routed experts)}. transformers 5 stores the
# experts fused ([E, 2I, H] and [E, H, I] per layer) and save_pretrained, which verl's merger calls,
# splits them into per-expert tensors; slimckpt streams each as a slice of its fused source.
MOE_SIZES = {"moe-0.7b": ("qwen3-moe", "0.25b", 16)}
SIZES = (*DENSE_SIZES, *MOE_SIZES)


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
    writer_stats: list = field(default_factory=list)  # slimckpt's writer, per run (writer_stats.WriterStats)


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


# verl's merger, measured in both orders of the same run: cold is the first verl merge of a turn (after the
# previous turn's slimckpt merges, or the disk and import measurements), warm directly follows it
VERL_COLD = "verl 0.9.1, cold"
VERL_WARM = "verl 0.9.1, warm"
NO_FSYNC = "slimckpt --no_fsync"


def is_verl(tool: str) -> bool:
    return tool.startswith("verl")


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


def _down(x: float) -> str:
    """Two decimals, rounded toward failing an at-least target (2.996 is 2.99, not 3.00)."""
    return f"{math.floor(x * 100) / 100:.2f}"


def _up(x: float) -> str:
    """Two decimals, rounded toward failing an at-most target (1.2004 is 1.21, not 1.20)."""
    return f"{math.ceil(x * 100) / 100:.2f}"


# One rounding per ratio, wherever it is printed (tables, targets, the words under them, docs/merge.md's block):
def speedup(verl_wall: float, ours_wall: float) -> str:
    """verl's wall / ours, two decimals, rounded down (toward failing 'at least 3x faster')."""
    return f"{_down(verl_wall / ours_wall)}x"


def floor_ratio(wall: float, floor: float) -> str:
    """wall / I/O floor, two decimals, rounded up (toward failing 'within 1.5x of the floor')."""
    return f"{_up(wall / floor)}x"


def rss_ratio(verl_peak: int, ours_peak: int) -> str:
    """verl's peak / ours, one decimal, rounded down (toward failing 'at least 10x lower')."""
    return f"{math.floor(verl_peak / ours_peak * 10) / 10:.1f}x"


def _short(tool: str) -> str:
    return tool.replace("verl 0.9.1", "verl")


def _label(tool: str) -> str:
    """A verl row's name in a sentence: "verl's warm merge"."""
    return f"verl's {tool.split(', ', 1)[1]} merge" if ", " in tool else _short(tool)


def reference(group: list[MergeRow]) -> MergeRow:
    """The verl row memory is compared with: the warm one (a JSON of an older run has one verl row)."""
    verl = [r for r in group if is_verl(r.tool)]
    return next((r for r in verl if r.tool == VERL_WARM), verl[0])


def fastest_verl(group: list[MergeRow]) -> MergeRow:
    """The verl row the speed target is judged against: the faster median, the harder comparison."""
    return min((r for r in group if is_verl(r.tool)), key=lambda r: r.wall_s)


def _verl_tools(rows: list[MergeRow]) -> list[str]:
    """verl's rows' names, the warm one (the reference) first."""
    return sorted(dict.fromkeys(r.tool for r in rows if is_verl(r.tool)), key=lambda t: t != VERL_WARM)


def merge_table(rows: list[MergeRow]) -> str:
    verl_tools = _verl_tools(rows)
    ref_tool = reference(rows).tool
    head = [
        "model",
        "params",
        "tool",
        "runs",
        "peak RssAnon",
        "wall (median)",
        "I/O floor",
        "wall / floor",
        f"RSS vs {_short(ref_tool)}",
    ] + [f"speed-up vs {_short(t)}" for t in verl_tools]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in dict.fromkeys(r.size for r in rows):
        group = [r for r in rows if r.size == size]
        base = reference(group)
        verl = {r.tool: r for r in group if is_verl(r.tool)}
        for r in group:
            cells = [
                size,
                f"{r.params / 1e9:.2f}B",
                r.tool,
                str(len(r.walls)),
                f"{r.peak_rss_anon / 2**20:,.0f} MiB",
                f"{r.wall_s:.1f} s",
                f"{r.io_floor_s:.1f} s",
                floor_ratio(r.wall_s, r.io_floor_s),
            ]
            if is_verl(r.tool):
                cells += ["-"] * (1 + len(verl_tools))
            else:
                cells.append(f"{rss_ratio(base.peak_rss_anon, r.peak_rss_anon)} lower")
                cells += [speedup(verl[t].wall_s, r.wall_s) if t in verl else "-" for t in verl_tools]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _order_words(rows: list[MergeRow]) -> str:
    """How the run ordered verl's merges, and what each order took."""
    tools = {r.tool for r in rows}
    if VERL_COLD in tools and VERL_WARM in tools:
        return (
            "verl's merger runs twice in each turn, back to back, so that both orders are measured: *cold* is "
            "the first verl merge of a turn (after the previous turn's slimckpt merges, or, in the first turn, "
            "after the disk and import measurements), *warm* directly follows it. slimckpt's speed-up is given "
            "against both; memory is compared with the warm runs. " + verl_orders(rows)
        )
    return (
        "This run measured verl's merger in one order only, once per turn, after the previous turn's slimckpt merges."
    )


def verl_orders(rows: list[MergeRow]) -> str:
    """What this run says about verl's two orders, size by size (nothing when the JSON has one verl row)."""
    parts, fewer = [], []
    for size in dict.fromkeys(r.size for r in rows):
        group = {r.tool: r for r in rows if r.size == size}
        cold, warm = group.get(VERL_COLD), group.get(VERL_WARM)
        if cold is None or warm is None:
            continue
        parts.append(f"{warm.wall_s:.1f} s warm and {cold.wall_s:.1f} s cold at {size}")
        if len(warm.walls) < len(cold.walls):
            fewer.append(f"{size} ({len(warm.walls)} of {len(cold.walls)})")
    if not parts:
        return ""
    text = "In this run verl's merger took (medians) " + ", ".join(parts) + "."
    if fewer:
        text += (
            " The warm merge ran in the first turns only at "
            + ", ".join(fewer)
            + ", to keep the bench short; the runs column counts each row's runs."
        )
    return text


def largest_output_tensor_bytes(size: str) -> int:
    """bf16: the embedding/lm_head or an MLP matrix (an MoE model's experts are a quarter of the
    dense MLP each, so its largest output is the embedding, though its fused sources are larger)."""
    layers, hidden, intermediate, vocab, heads, kv_heads = PRESETS[MOE_SIZES[size][1] if size in MOE_SIZES else size]
    return 2 * max(vocab * hidden, intermediate * hidden)


def moe_targets(rows: list[MergeRow]) -> str:
    """The MoE row's targets: the dense rows' flat memory bound, and at least as fast as
    verl's merger in both of its orders."""
    lines = []
    for size in [s for s in dict.fromkeys(r.size for r in rows) if s in MOE_SIZES]:
        group = [r for r in rows if r.size == size]
        ours = next(r for r in group if r.tool == "slimckpt")
        budget = largest_output_tensor_bytes(size) + 256 * 2**20
        family, _, experts = MOE_SIZES[size]
        checks = [
            (
                f"{size} ({family}, {experts} experts): peak RssAnon at most the largest output tensor + 256 MiB "
                f"({budget / 2**20:.0f} MiB)",
                ours.peak_rss_anon <= budget,
                f"{ours.peak_rss_anon / 2**20:.0f} MiB",
            )
        ]
        checks += [
            (
                f"{size}: wall at least as fast as {_label(r.tool)}",
                ours.wall_s <= r.wall_s,
                f"{ours.wall_s:.1f} s vs {r.wall_s:.1f} s ({speedup(r.wall_s, ours.wall_s)})",
            )
            for r in group
            if is_verl(r.tool)
        ]
        lines += [f"| {name} | {'yes' if ok else '**no**'} | {value} |" for name, ok, value in checks]
    return "\n".join(["| target | met | measured |", "|---|---|---|", *lines]) if lines else ""


def targets(rows: list[MergeRow], disk=None, imports_s: float | None = None, disks: list | None = None) -> str:
    """The intermediate tier's targets, checked on the largest dense model of the run."""
    rows = [r for r in rows if r.size not in MOE_SIZES] or rows
    largest = max(rows, key=lambda r: r.params).size
    ours = next(r for r in rows if r.size == largest and r.tool == "slimckpt")
    group = [r for r in rows if r.size == largest]
    verl = reference(group)  # memory: the warm runs
    fastest = fastest_verl(group)  # speed: the faster of verl's orders, the harder comparison
    others = [r for r in group if is_verl(r.tool) and r is not fastest]
    budget = largest_output_tensor_bytes(largest) + 256 * 2**20
    fast = next((r for r in rows if r.size == largest and r.tool == NO_FSYNC), None)
    mine = sorted((r.params, r.peak_rss_anon) for r in rows if r.tool == "slimckpt")
    theirs = sorted(
        (r.params, r.peak_rss_anon)
        for r in (reference([r for r in rows if r.size == size]) for size in dict.fromkeys(r.size for r in rows))
    )
    against = _label(fastest.tool)
    speed_value = speedup(fastest.wall_s, ours.wall_s) + "".join(
        f" (vs {_label(r.tool)}: {speedup(r.wall_s, ours.wall_s)})" for r in others
    )
    checks = [
        (
            f"peak RssAnon at least 10x lower than verl's ({largest}"
            + (", its warm runs)" if verl.tool == VERL_WARM else ")"),
            verl.peak_rss_anon / ours.peak_rss_anon >= 10,
            rss_ratio(verl.peak_rss_anon, ours.peak_rss_anon),
        ),
        (
            f"peak RssAnon at most the largest output tensor + 256 MiB ({budget / 2**20:.0f} MiB)",
            ours.peak_rss_anon <= budget,
            f"{ours.peak_rss_anon / 2**20:.0f} MiB",
        ),
        (
            "our peak roughly flat across sizes (largest / smallest <= 1.2)",
            mine[-1][1] / mine[0][1] <= 1.2,
            f"{_up(mine[-1][1] / mine[0][1])}",
        ),
        (
            "verl's peak grows with the model",
            theirs[-1][1] > 1.5 * theirs[0][1],
            f"{theirs[-1][1] / theirs[0][1]:.2f}x",
        ),
        (f"wall at least 3x faster than {against} ({largest})", fastest.wall_s / ours.wall_s >= 3, speed_value),
        (
            f"wall within 1.5x of the I/O floor ({largest})",
            ours.wall_s / ours.io_floor_s <= 1.5,
            floor_ratio(ours.wall_s, ours.io_floor_s),
        ),
    ]
    lines = ["| target | met | measured |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if ok else '**no**'} | {value} |" for name, ok, value in checks]
    if others:
        lines += [
            "",
            f"The speed target is judged against {against} ({fastest.wall_s:.1f} s at {largest}), the "
            f"faster of verl's two orders in this run and so the harder comparison; "
            + ", ".join(f"{_label(r.tool)} took {r.wall_s:.1f} s" for r in others)
            + ".",
        ]
    goal = fastest.wall_s / 3
    if imports_s is not None and goal < imports_s <= ours.wall_s:
        lines += [
            "",
            f"3x faster than {against} would be {goal:.1f} s at {largest}. Starting Python and importing what "
            f"the commit waits for (torch and transformers' modeling code, which name the "
            f"tensors and write the config files as verl does) took {imports_s:.1f} s at best in this run, "
            f"before any merge work.",
        ]
    smallest = min((r for r in rows if r.tool == "slimckpt"), key=lambda r: r.params)
    lines += _floor_analysis(
        ours, disks or ([disk] if disk is not None else []), imports_s, smallest if smallest is not ours else None
    )
    if fast is not None:
        if max(fast.walls) < min(ours.walls):
            verdict = (
                f"{ours.wall_s - fast.wall_s:.1f} s less than with fsync, each of its runs faster than every "
                f"one of the default's: fsync costs that much"
            )
        elif min(fast.walls) > max(ours.walls):
            verdict = "each of its runs slower than every one of the default's: fsync is not what bounds it"
        else:
            verdict = "its runs within the spread of the default's: fsync is not what bounds it"
        lines += [
            "",
            f"Without fsync (`--no_fsync`, not crash-safe) it takes {fast.wall_s:.1f} s, {verdict}.",
        ]
    return "\n".join(lines)


def _floor_analysis(
    ours: MergeRow, disks: list, imports_s: float | None, smallest: MergeRow | None = None
) -> list[str]:
    """What the run says about the wall/floor ratio: how much the runs spread, what the disk does
    when a merge reads and writes at once, and the floor at the run's typical disk speed."""
    if not disks:
        return []
    gb, moved = 1e9, ours.read_bytes + ours.written_bytes
    walls = sorted(ours.walls) or [ours.wall_s]
    lines = [
        "",
        f"slimckpt's {len(walls)} runs at {ours.size} took {walls[0]:.1f}-{walls[-1]:.1f} s "
        f"({_up(walls[0] / ours.io_floor_s)}-{_up(walls[-1] / ours.io_floor_s)}x the floor). "
        f"The floor adds the best isolated read and write times of the run.",
    ]
    mixed = sorted(d.mixed_bytes_per_s for d in disks if getattr(d, "mixed_bytes_per_s", 0))
    if mixed:
        lines[-1] += (
            f" A merge reads and writes at once, which this disk served at {mixed[0] / gb:.2f}-"
            f"{mixed[-1] / gb:.2f} GB/s combined in the run's {len(mixed)} measurements: "
            f"{moved / mixed[-1]:.1f}-{moved / mixed[0]:.1f} s for these bytes, against the "
            f"{1.5 * ours.io_floor_s:.1f} s that 1.5x the floor allows. slimckpt's median moved them at "
            f"{moved / ours.wall_s / gb:.2f} GB/s, Python's start and the commit included."
        )
    if len(disks) > 1:
        typical = DiskSpeed(
            median([d.write_bytes_per_s for d in disks]),
            median([d.read_bytes_per_s for d in disks]),
            disks[0].size_bytes,
        )
        typical_floor = typical.io_floor_s(ours.read_bytes, ours.written_bytes)
        lines[-1] += (
            f" With the median of the run's disk measurements instead of the best, the floor would be "
            f"{typical_floor:.1f} s and the median wall {_up(ours.wall_s / typical_floor)}x it "
            f"(for information; the target is judged on the best)."
        )
    lines += _writer_analysis(ours)
    if imports_s and smallest is not None:
        lines += [
            "",
            f"Starting Python and importing torch and transformers took {imports_s:.1f} s at best in this "
            f"run, before slimckpt plans the merge and writes a byte. The smallest model's merge ({smallest.size}, its bytes "
            f"{smallest.io_floor_s:.1f} s at the floor) took {smallest.wall_s:.1f} s.",
        ]
    return lines


def _writer_analysis(ours: MergeRow) -> list[str]:
    """What bounded slimckpt's writer in this run: its casts, whose page faults on the mapped rank
    files are the reads (the disk's reads, or the CPU), or the writes behind them."""
    runs = [WriterStats.from_dict(d) for d in ours.writer_stats]
    runs = [r for r in runs if r.wall_s > 0]
    if not runs:
        return []

    def span(values: list[float], fmt: str) -> str:
        lo, hi = min(values), max(values)
        return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}-{format(hi, fmt)}"

    casting = [100 * r.cast_s / r.wall_s for r in runs]
    return [
        "",
        f"Where slimckpt's writer spent its time, in {len(runs)} of "
        f"these runs: it took {span([r.wall_s for r in runs], '.1f')} s, casting for {span(casting, '.0f')}% "
        f"of that (the reads of the rank files included: they are the casts' page faults), and "
        f"{span([r.close_s for r in runs], '.2f')} s on the last writes and the fsyncs. "
        + (
            "The reads and casts, not the writes, bound the merge."
            if min(casting) >= 90
            else "The rest of the time the cast waited for the writes."
        ),
    ]


def machine_line(disk) -> str:
    import torch

    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, torch {torch.__version__}"
    )


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


# what a merge run exercises: slimckpt's code and this script (verl is pinned)
CODE_PATHS = ("patches", "scripts/bench/merge.py")


def source_commit() -> dict:
    """The commit the measured code is at, and whether the working tree changed it (None: no git)."""
    head = _git("rev-parse", "--short=7", "HEAD")
    dirty = _git("status", "--porcelain", "--", *CODE_PATHS)
    return {"commit": head, "dirty": bool(dirty) if dirty is not None else None}


def _commit_words(meta: dict) -> str:
    commit = meta.get("commit")
    if not commit:
        return "commit not recorded"
    return f"commit {commit}" + (f" with uncommitted changes to {' or '.join(CODE_PATHS)}" if meta.get("dirty") else "")


def _make_bench_words() -> str:
    """How `make bench` calls this script, read from the Makefile."""
    try:
        line = next(ln.strip() for ln in (REPO / "Makefile").read_text().splitlines() if "scripts.bench.merge" in ln)
    except (OSError, StopIteration):
        return "`make bench` not found"
    return f"`make bench` runs `{line.replace('$(PY)', 'python')}`"


def _load_words(meta: dict) -> str:
    load = meta.get("load_average_1min")
    if not load:
        return ""
    text = (
        f" The machine is shared: its 1-minute load average was {load['start']:.2f} when the run started and "
        f"{load['end']:.2f} when it ended"
    )
    merges = load.get("merges")
    if merges:
        text += (
            f"; as each of the {len(merges)} merges started it was {min(merges):.2f}-{max(merges):.2f}, median "
            f"{median(merges):.2f} (the bench's own previous merge counts in it)"
        )
    return text + "."


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
    print(
        f"[bench] {meta['machine']}; {_commit_words(meta)}; load {meta['load_average_1min']['start']:.2f}", flush=True
    )
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


SAVE_BEGIN, SAVE_END = "<!-- save-bench:begin -->", "<!-- save-bench:end -->"
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


def _disks(meta: dict) -> tuple[DiskSpeed, list[DiskSpeed]]:
    disk = DiskSpeed(**meta["disk"])
    return disk, [DiskSpeed(**d) for d in meta.get("disk_measurements", [])] or [disk]


def _span(values: list[float], fmt: str, unit: str = "") -> str:
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


def summary_block(rows: list[MergeRow], meta: dict) -> str:
    """docs/merge.md's table and the paragraph that quotes this run: every number from the run's JSON."""
    disk, disks = _disks(meta)
    verl_tools = _verl_tools(rows)
    ref_tool = reference(rows).tool
    head = (
        [
            "model",
            "verl 0.9.1 peak RssAnon" + (" (warm runs)" if ref_tool == VERL_WARM else ""),
            "slimckpt peak RssAnon",
        ]
        + [_short(t).replace("verl", "verl wall", 1) for t in verl_tools]
        + ["slimckpt wall"]
        + [f"speed-up vs {_short(t)}" for t in verl_tools]
        + ["slimckpt wall / I/O floor"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in dict.fromkeys(r.size for r in rows):
        group = {r.tool: r for r in rows if r.size == size}
        ours, base = group["slimckpt"], reference(list(group.values()))
        kind = f" MoE ({MOE_SIZES[size][2]} experts)" if size in MOE_SIZES else ""
        cells = [
            f"{ours.params / 1e9:.2f}B{kind}",
            f"{base.peak_rss_anon / 2**20:,.0f} MiB",
            f"{ours.peak_rss_anon / 2**20:,.0f} MiB ({rss_ratio(base.peak_rss_anon, ours.peak_rss_anon)} lower)",
        ]
        cells += [f"{group[t].wall_s:.1f} s" if t in group else "-" for t in verl_tools] + [f"{ours.wall_s:.1f} s"]
        cells += [speedup(group[t].wall_s, ours.wall_s) if t in group else "-" for t in verl_tools]
        cells.append(floor_ratio(ours.wall_s, ours.io_floor_s))
        lines.append("| " + " | ".join(cells) + " |")
    largest = max(rows, key=lambda r: r.params).size
    group = [r for r in rows if r.size == largest]
    ours = next(r for r in group if r.tool == "slimckpt")
    fastest, others = fastest_verl(group), [r for r in group if is_verl(r.tool) and r is not fastest_verl(group)]
    gb = 1e9
    words = [
        f"At {largest} slimckpt took {ours.wall_s:.1f} s: "
        + " and ".join(
            f"{speedup(r.wall_s, ours.wall_s)} faster than {_label(r.tool)} ({r.wall_s:.1f} s)"
            for r in [fastest] + others
        )
        + f". It took {floor_ratio(ours.wall_s, ours.io_floor_s)} the I/O floor."
    ]
    if VERL_WARM in verl_tools and VERL_COLD in verl_tools:
        words.append(
            "verl's merger runs twice in each turn of the bench, back to back: *cold* after the "
            "slimckpt merges, *warm* directly after its own cold merge."
        )
    words.append(
        f"This run (`{meta.get('command', 'python -m scripts.bench.merge')}`, {_commit_words(meta)}, "
        f"{meta['date']}) measured the disk at best at {disk.write_bytes_per_s / gb:.2f} GB/s written and "
        f"{disk.read_bytes_per_s / gb:.2f} GB/s read"
        + (
            f" ({disk.direct_read_bytes_per_s / gb:.2f} GB/s read with O_DIRECT)"
            if disk.direct_read_bytes_per_s
            else ""
        )
        + f", so the {largest} floor is {ours.io_floor_s:.1f} s; slimckpt's {len(ours.walls)} runs at "
        f"{largest} took {_span(ours.walls, '.1f', ' s')}."
    )
    merges = (meta.get("load_average_1min") or {}).get("merges")
    if merges:
        words.append(
            f"The machine was shared: its 1-minute load average was {min(merges):.2f}-{max(merges):.2f} "
            f"(median {median(merges):.2f}) as the merges started."
        )
    mixed = [d.mixed_bytes_per_s for d in disks if d.mixed_bytes_per_s]
    if mixed:
        moved = ours.read_bytes + ours.written_bytes
        words.append(
            f"A streaming merge reads and writes at once, and this disk served that at "
            f"{_span([m / gb for m in mixed], '.2f')} GB/s combined: "
            f"{_span([moved / m for m in mixed], '.1f')} s for a {largest} merge's bytes."
        )
    stats = [WriterStats.from_dict(d) for d in ours.writer_stats]
    stats = [w for w in stats if w.wall_s > 0]
    if stats:
        words.append(
            f"Every bench run records where the merge's writer's time went (`SLIMCKPT_MERGE_STATS`): "
            f"in this one it took {_span([w.wall_s for w in stats], '.1f')} s, casting (the reads of the rank "
            f"files included) for {_span([100 * w.cast_s / w.wall_s for w in stats], '.0f')}% of that."
        )
    shards = ours.read_bytes
    base = reference(group)
    words.append(f"verl's peak at {largest} was {base.peak_rss_anon / shards:.2f}x the bytes of its fp32 shard files.")
    return "\n".join(lines) + "\n\n" + "\n".join(_wrap(" ".join(words)))


def _wrap(text: str, width: int = 110) -> list[str]:
    return textwrap.wrap(text, width=width, break_long_words=False, break_on_hyphens=False)


def _imports_words(imports_s: float | None) -> str:
    if imports_s is None:
        return "not measured in this run"
    return (
        f"{imports_s:.1f} s with Python's start at best in this run, measured at the start, before each "
        f"size and at the end, as the disk is"
    )


def _moe_section(rows: list[MergeRow]) -> str:
    table = moe_targets(rows)
    return (
        f"""
### Targets (mixture of experts)

{table}
"""
        if table
        else ""
    )


def render_report(rows: list[MergeRow], meta: dict, args) -> str:
    disk, disks = _disks(meta)
    imports_s = meta.get("imports_s")
    plot_rel = os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.out)))
    machine = meta.get("machine") or machine_line(disk)  # an older JSON did not record it: this machine's
    orders = _order_words(rows)
    return f"""# Benchmarks

The merge section: `{meta.get("command", "python -m scripts.bench.merge")}` (sizes {meta["sizes"]}, {meta["repeats"]} repeats;
{_make_bench_words()}), on {_commit_words(meta)}, {meta["date"]}, in {meta["seconds"] / 60:.1f} minutes.
Machine: {machine}; disk measured in this run: {disk.describe()} (fastest of the run's measurements).{_load_words(meta)}
verl 0.9.1 and slimckpt are measured in the same run, on the same checkpoint files.

## Merge: FSDP2 checkpoint (world size 2) to Hugging Face safetensors (bf16)

Checkpoints are written by verl's own `FSDPCheckpointManager` (model shards, fp32). verl:
`python -m verl.model_merger merge --backend fsdp` with `SLIMCKPT_DISABLE=1`; slimckpt: `slimckpt merge`.
Peak RssAnon is the peak anonymous memory of the merge, sampled from outside (largest over the
runs): the process's RssAnon every 10 ms, and, where a merge runs more than one process, the sum of
their Pss_Anon every 50 ms (pages they share counted once; summing their RssAnon would count them
twice); the larger of the two is reported. Wall is the median of
the runs (the runs column) with the input pages evicted from the page cache before each run; the tools take
turns run after run, so a slow minute of the VM falls on all of them. {orders} I/O floor =
bytes read / read bandwidth + bytes written / write bandwidth, with the bandwidths measured in this
run at the start, before each model size and at the end (`slimckpt.observe.diskspeed`: 1 GiB written and
fsync'ed, then read cold, through the page cache and with O_DIRECT in 1 and 16 MiB requests,
medians of 3); each is the
fastest over those measurements and the two paths, i.e. the best this disk did in the run (its
speed drifts by up to 1.5x within minutes here). Ratios: speed-ups and wall / floor have two decimals,
rounded toward failing their targets (speed-ups down, wall / floor up); memory ratios one decimal, down.

{merge_table(rows)}

![peak memory vs model size]({plot_rel})

### Targets (intermediate tier)

{targets(rows, disk, imports_s, disks)}
{_moe_section(rows)}
Wall times are whole processes, Python and library imports included (both tools import torch and
transformers, verl's merger verl too). slimckpt's imports: {_imports_words(imports_s)}; it plans
and writes once they are done.
slimckpt fsyncs every file it writes and verl's merger does not. Both read the shards and write
the output through the page cache.
"""


if __name__ == "__main__":
    sys.exit(main())
