#!/usr/bin/env python3
"""Compare verl training runs logged to wandb: reward and validation curves overlaid in one PNG
(restarts marked), and a markdown table of final values, checkpoint saves and step-by-step
equality with a reference run (printed, optionally saved).

Each RUN is `[LABEL=]PATH[,PATH...]`: PATH is a wandb offline run directory (offline-run-*), a
directory holding such runs (a WANDB_DIR or its wandb/ folder: all runs below it, oldest first),
or an online run path entity/project/run_id. Several PATHs (or several runs below one directory)
form one curve: a run resumed from a checkpoint continues the killed run's curve, and where both
logged the same step the later run wins.

Examples:
  python -m scripts.compare.runs runs/compare/grpo/default runs/compare/grpo/quickstart --out cmp.png
  python -m scripts.compare.runs verl=runs/a/wandb resumed=runs/b/wandb/offline-run-1,runs/b/wandb/offline-run-2
  python -m scripts.compare.runs me/slimckpt_tiny/abc123 me/slimckpt_tiny/def456 --table cmp.md

The table's "vs <reference>" columns compare each curve with the first RUN (or --reference) step
by step: "identical" means every logged value at every common step is bit-for-bit equal and both
logged the same steps. The last column does that for every metric both runs logged except wall
times, throughput, memory and ckpt/* (losses, gradient norms, KL, entropy, lengths, scores...).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

from slimckpt.observe.wandb_history import HistoryError, RunHistory, load

# lazy imports: matplotlib loads only to draw the PNG

REWARD_KEY = "critic/score/mean"
MEMORY_KEY = "ckpt/peak_rss_extra_gb"
HOST_RSS_KEY = "ckpt/peak_host_rss_gb"
SECONDS_KEY = "ckpt/seconds"
VAL_PREFIX = "val-core/"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="compare_runs.py",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="[LABEL=]PATH[,PATH...] (see above)")
    p.add_argument("--out", default="compare_runs.png", help="PNG to write (default: %(default)s)")
    p.add_argument("--table", default=None, help="also write the markdown table to this file")
    p.add_argument("--title", default=None, help="figure title")
    p.add_argument("--reward-key", default=REWARD_KEY, help="reward metric (default: %(default)s)")
    p.add_argument(
        "--val-key",
        default=None,
        help=f"validation metric (default: the first {VAL_PREFIX}*/mean@* key the runs share)",
    )
    p.add_argument(
        "--memory-key",
        default=MEMORY_KEY,
        help="memory metric logged at each save, for the table (default: %(default)s, GB above the RSS "
        "before the save)",
    )
    p.add_argument(
        "--mark",
        action="append",
        default=[],
        metavar="STEP=TEXT",
        help="a vertical line at STEP named TEXT in the legend (a resume or kill point); repeatable",
    )
    p.add_argument(
        "--smooth",
        type=int,
        default=5,
        help="the reward panel shows the mean of the last N steps (default: %(default)s; 1: raw)",
    )
    p.add_argument("--reference", default=None, help="LABEL of the run the others are compared with (default: first)")
    return p.parse_args(argv)


def pick_val_key(histories: list[RunHistory]) -> str | None:
    shared = set.intersection(*(h.keys() for h in histories))
    candidates = sorted(k for k in shared if k.startswith(VAL_PREFIX))
    preferred = [k for k in candidates if "/mean@" in k]
    return (preferred or candidates or [None])[0]


def compare_curves(ref: list[tuple[int, float]], other: list[tuple[int, float]]) -> str:
    """'identical' or where and by how much two step -> value curves differ."""
    if not ref or not other:
        return "n/a"
    a, b = dict(ref), dict(other)
    common = sorted(set(a) & set(b))
    diffs = [(s, abs(a[s] - b[s])) for s in common if a[s] != b[s] and not (math.isnan(a[s]) and math.isnan(b[s]))]
    if not diffs and set(a) == set(b):
        return f"identical ({len(common)} steps)"
    if not diffs:
        return f"equal on {len(common)} common steps, steps differ ({len(a)} vs {len(b)})"
    first = diffs[0][0]
    worst = max(d for _, d in diffs)
    return f"differs from step {first} (max abs diff {worst:.3g}, {len(diffs)}/{len(common)} steps)"


# run-specific by nature: wall times, throughput, memory, the save's own metrics
NOT_TRAINING = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/", "critic/perf/", "ckpt/")


def compare_all(ref: RunHistory, other: RunHistory) -> str:
    """Every training metric both runs logged (not times, memory or ckpt/*), compared step by step."""
    keys = sorted(k for k in ref.keys() & other.keys() if not k.startswith(NOT_TRAINING))
    differing = []
    for key in keys:
        verdict = compare_curves(ref.series(key), other.series(key))
        if not verdict.startswith("identical"):
            differing.append((key, verdict))
    if not differing:
        return f"identical ({len(keys)} metrics)"
    key, verdict = differing[0]
    return f"{len(differing)}/{len(keys)} differ, e.g. `{key}` {verdict}"


def _fmt(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}g}"


def _last(series: list[tuple[int, float]]) -> float | None:
    return series[-1][1] if series else None


def table(
    histories: list[RunHistory], reward_key: str, val_key: str | None, memory_key: str, reference: RunHistory
) -> str:
    ref_name = reference.name
    header = [
        "run",
        "steps",
        f"final `{reward_key}`",
        f"final `{val_key}`" if val_key else "final validation",
        "saves",
        "max save RSS extra (MiB)",
        "max save peak RSS (GB)",
        "mean save s",
        f"reward vs `{ref_name}`",
        f"validation vs `{ref_name}`",
        f"all training metrics vs `{ref_name}`",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for h in histories:
        reward = h.series(reward_key)
        val = h.series(val_key) if val_key else []
        mem = h.series(memory_key)
        peak = h.series(HOST_RSS_KEY)
        secs = h.series(SECONDS_KEY)
        same = h is reference
        row = [
            f"`{h.name}`",
            str(h.last_step()),
            _fmt(_last(reward)),
            _fmt(_last(val)),
            str(len(mem)),
            _fmt(max(v for _, v in mem) * 1e9 / 2**20, 3) if mem else "n/a",
            _fmt(max(v for _, v in peak), 3) if peak else "n/a",
            _fmt(sum(v for _, v in secs) / len(secs), 3) if secs else "n/a",
            "(reference)" if same else compare_curves(reference.series(reward_key), reward),
            "(reference)" if same else compare_curves(reference.series(val_key) if val_key else [], val),
            "(reference)" if same else compare_all(reference, h),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


VARIANT_STYLES = {"": ("-", "o"), "resume": ("--", "s"), "sigkill": (":", "X")}


def recipe_and_variant(name: str) -> tuple[str, str]:
    """`quickstart_resume` -> (quickstart, resume); a name without a known variant suffix is its own recipe."""
    base, _, variant = name.rpartition("_")
    return (base, variant) if base and variant in VARIANT_STYLES else (name, "")


def line_style(name: str, colour: int, reference: str, order: int, count: int) -> dict:
    """The reference (verl's defaults) widest, solid and grey; the others on top of it in a colour
    per recipe and a dash pattern and marker per variant (`<recipe>_resume`, `<recipe>_sigkill`),
    each drawn narrower than the one before (order of count), so curves that are identical show
    as nested stripes instead of hiding each other."""
    if name == reference:
        return {
            "color": "black",
            "linestyle": "-",
            "marker": "o",
            "linewidth": 11.0,
            "markersize": 15,
            "alpha": 0.25,
            "zorder": 1,
        }
    linestyle, marker = VARIANT_STYLES[recipe_and_variant(name)[1]]
    shrink = order / max(count - 1, 1)
    return {
        "color": f"C{colour}",
        "linestyle": linestyle,
        "marker": marker,
        "linewidth": 8.0 - 6.8 * shrink,
        "markersize": 10.0 - 6.0 * shrink,
        "alpha": 0.9,
        "zorder": 2 + order,
    }


def running_mean(series: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """Each step's value averaged with the window-1 logged before it (fewer at the start)."""
    out = []
    for i, (step, _) in enumerate(series):
        chunk = [v for _, v in series[max(0, i - window + 1) : i + 1]]
        out.append((step, sum(chunk) / len(chunk)))
    return out


def parse_mark(text: str) -> tuple[int, str]:
    """`STEP=TEXT` (--mark) -> (step, text)."""
    step, sep, label = text.partition("=")
    if not sep or not step.strip().isdigit() or not label:
        raise ValueError(f"--mark {text!r}: expected STEP=TEXT, e.g. 15=stopped and resumed")
    return int(step), label


def plot(
    histories: list[RunHistory],
    reward_key: str,
    val_key: str | None,
    out: str,
    title: str | None,
    reference: str,
    smooth: int,
    marks: list[tuple[int, str]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (reward_ax, val_ax) = plt.subplots(1, 2, figsize=(15, 5.4))
    recipes = dict.fromkeys(recipe_and_variant(h.name)[0] for h in histories if h.name != reference)
    colour = {recipe: i for i, recipe in enumerate(recipes)}

    def colour_of(h: RunHistory) -> int:
        return colour.get(recipe_and_variant(h.name)[0], 0)

    others = [h for h in histories if h.name != reference]
    for h in histories:
        order = others.index(h) if h in others else 0
        style = line_style(h.name, colour_of(h), reference, order, len(others))
        reward = running_mean(h.series(reward_key), smooth)
        if reward:
            reward_ax.plot([s for s, _ in reward], [v for _, v in reward], label=h.name, **{**style, "marker": None})
        val = h.series(val_key) if val_key else []
        if val:
            val_ax.plot([s for s, _ in val], [v for _, v in val], label=h.name, **style)
    for ax in (reward_ax, val_ax):
        for i, (step, label) in enumerate(marks):
            # one line per event, named in the reward panel's legend (resume and kill points)
            ax.axvline(
                step,
                color=("dimgray", "firebrick", "navy")[i % 3],
                linestyle=":",
                linewidth=1.4,
                label=f"step {step}: {label}" if ax is reward_ax else None,
            )
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    reward_ax.set_title(f"training reward (mean of the last {smooth} steps)" if smooth > 1 else "training reward")
    reward_ax.set_ylabel(reward_key)
    val_ax.set_title("validation (greedy answers, every validation step)")
    val_ax.set_ylabel(val_key or "(no validation metric)")
    val_ax.legend(fontsize=8, loc="best", title=f"run (thick grey: {reference}, the reference)", title_fontsize=8)
    if marks:
        reward_ax.legend(
            handles=[h for h in reward_ax.get_lines() if h.get_label().startswith("step ")], fontsize=7, loc="best"
        )
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    # write next to the target and rename: an interrupted run never leaves a partial PNG behind
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".compare_runs.", suffix=".png", dir=out_path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, out_path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        histories = [load(spec) for spec in args.runs]
    except HistoryError as exc:
        print(f"compare_runs.py: {exc}", file=sys.stderr)
        return 2
    names = [h.name for h in histories]
    if len(set(names)) != len(names):
        print(
            f"compare_runs.py: two runs are both labelled {sorted(n for n in names if names.count(n) > 1)[0]!r}; "
            "give each a LABEL= prefix",
            file=sys.stderr,
        )
        return 2
    reference = histories[0]
    if args.reference:
        matches = [h for h in histories if h.name == args.reference]
        if not matches:
            print(f"compare_runs.py: --reference {args.reference!r} is none of {names}", file=sys.stderr)
            return 2
        reference = matches[0]
    try:
        marks = [parse_mark(m) for m in args.mark]
    except ValueError as exc:
        print(f"compare_runs.py: {exc}", file=sys.stderr)
        return 2
    val_key = args.val_key or pick_val_key(histories)
    text = table(histories, args.reward_key, val_key, args.memory_key, reference)
    plot(histories, args.reward_key, val_key, args.out, args.title, reference.name, args.smooth, marks)
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{args.table}.partial"
        Path(tmp).write_text(text)
        os.replace(tmp, args.table)
    print(text, end="")
    print(f"\nwrote {args.out}" + (f" and {args.table}" if args.table else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
