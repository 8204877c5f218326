"""The merge bench's report: BENCHMARKS.md's merge section, its targets and docs/merge.md's block, from the measured rows
and the run's meta (its --json). Nothing here runs a merge or measures; scripts/bench/merge.py does."""

from __future__ import annotations

import math
import os
import platform
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from slimckpt.engine.writer_stats import WriterStats
from slimckpt.observe.diskspeed import DiskSpeed
from slimckpt.observe.measure import median

# Presets of the checkpoint builder (Llama, untied embeddings, vocab 32000): about 0.25B, 0.5B, 1B parameters.
from slimckpt_testing.verl_checkpoints.fsdp_checkpoint import PRESETS

# lazy imports: torch only for an older JSON without its machine line

REPO = Path(__file__).resolve().parents[2]

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


# verl's merger, measured in both orders of the same run: cold is the first verl merge of a turn (after the
# previous turn's slimckpt merges, or the disk and import measurements), warm directly follows it
VERL_COLD = "verl 0.9.1, cold"
VERL_WARM = "verl 0.9.1, warm"
NO_FSYNC = "slimckpt --no_fsync"


def is_verl(tool: str) -> bool:
    return tool.startswith("verl")


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


# what a merge run exercises: slimckpt's code and this script (verl is pinned)
CODE_PATHS = ("patches", "scripts/bench/merge.py")


def commit_words(meta: dict) -> str:
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
        f"This run (`{meta.get('command', 'python -m scripts.bench.merge')}`, {commit_words(meta)}, "
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
{_make_bench_words()}), on {commit_words(meta)}, {meta["date"]}, in {meta["seconds"] / 60:.1f} minutes.
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
