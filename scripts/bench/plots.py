"""Pictures of the measured sizes: merge peak memory and wall against model size up to 8B (the I/O floor
drawn), a save's peak extra memory against size, and the job's memory over one save at the largest
in-training size. Reads the committed bench JSONs; measures nothing.

    python -m scripts.bench.plots            # docs/merge_scale.png, docs/save_peak_memory.png,
                                             # docs/save_rss_timeline.png (from make bench-train-scale)
"""

# lazy imports: matplotlib only when a picture is drawn (the tests import the point tables)
from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import median

GIB = 2**30
DOCS = Path(__file__).resolve().parents[2] / "docs"


def merge_points(merge: dict, scale: dict) -> dict[str, list[tuple[float, float, float, float]]]:
    """tool -> [(params in billions, peak GiB, median wall s, I/O floor s)], dense sizes of `make bench`
    and the 8B point of `make bench-scale` (each with the floor measured in its own run)."""
    pts: dict[str, list[tuple[float, float, float, float]]] = {}
    for r in merge["rows"]:
        if r["size"].startswith("moe"):
            continue
        tool = {"slimckpt": "slimckpt merge", "verl 0.9.1, warm": "verl 0.9.1 merger"}.get(r["tool"])
        if tool:
            pts.setdefault(tool, []).append((r["params"] / 1e9, r["peak_rss_anon"] / GIB, r["wall_s"], r["io_floor_s"]))
    params = scale["build"]["params"] / 1e9
    for r in scale["rows"]:
        if r["tool"] == "slimckpt merge":
            pts["slimckpt merge"].append((params, max(r["peaks"]) / GIB, median(r["walls"]), r["io_floor_s"]))
    return {k: sorted(v) for k, v in pts.items()}


def plot_merge(merge: dict, scale: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = merge_points(merge, scale)
    fig, (mem, wall) = plt.subplots(1, 2, figsize=(11, 4.2))
    colour = {"slimckpt merge": "C0", "verl 0.9.1 merger": "C1"}
    for tool, rows in pts.items():
        mem.plot([p[0] for p in rows], [p[1] for p in rows], marker="o", label=tool, color=colour[tool])
    verl = scale["verl"]
    params = scale["build"]["params"] / 1e9
    ref = scale["verl_reference"]
    need = ref["per_shard_byte"] * scale["build"]["shard_bytes"] / GIB
    mem.scatter(
        [params],
        [verl["peak_rss_anon"] / GIB],
        marker="x",
        color="C1",
        s=60,
        zorder=3,
        label=f"verl killed at the {scale['verl_cap'] / GIB:.0f} GiB cap",
    )
    mem.scatter(
        [params],
        [need],
        marker="^",
        facecolors="none",
        edgecolors="C1",
        s=60,
        zorder=3,
        label=f"verl's need from its {ref['preset']} ratio ({need:.0f} GiB)",
    )
    mem.set_yscale("log")
    mem.set_xlabel("model parameters (billions)")
    mem.set_ylabel("peak anonymous RSS (GiB, log)")
    mem.set_title("Merge to HF safetensors: memory")
    mem.grid(alpha=0.3, which="both")
    mem.legend(fontsize=8)
    ours = pts["slimckpt merge"]
    wall.plot([p[0] for p in ours], [p[2] for p in ours], marker="o", color="C0", label="slimckpt merge (median wall)")
    wall.plot(
        [p[0] for p in ours], [p[3] for p in ours], linestyle="--", color="grey", label="I/O floor of the same run"
    )
    if "verl 0.9.1 merger" in pts:
        v = pts["verl 0.9.1 merger"]
        wall.plot([p[0] for p in v], [p[2] for p in v], marker="o", color="C1", label="verl 0.9.1 merger")
    wall.set_xscale("log")
    wall.set_yscale("log")
    ticks = [0.25, 0.5, 1, 2, 4, 8]
    wall.set_xticks(ticks, [f"{t:g}" for t in ticks])
    wall.minorticks_off()
    wall.set_xlabel("model parameters (billions, log)")
    wall.set_ylabel("seconds (log)")
    wall.set_title("Merge to HF safetensors: wall time")
    wall.grid(alpha=0.3, which="both")
    wall.legend(fontsize=8)
    fig.suptitle(
        f"0.25-1B: `make bench` at {merge['commit']} (world size 2); "
        f"8B: `make bench-scale` at {scale['commit']} (world size 8)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_save(save: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {
        "verl": "verl 0.9.1 (hf_model)",
        "incremental": "+recipe=incremental",
        "async": "incremental, async_save=pool",
        "stream": "incremental, async_save=stream",
    }
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for mode, label in names.items():
        rows = sorted(
            (r["params"] / 1e9, r["peak_extra"] / 2**20, r.get("staged")) for r in save["rows"] if r["mode"] == mode
        )
        if not rows:
            continue
        (line,) = ax.plot([p[0] for p in rows], [p[1] for p in rows], marker="o", label=label)
        unstaged = [p for p in rows if p[2] is False]  # pool mode that did not fit its host budget saved in place
        if unstaged:
            ax.scatter(
                [p[0] for p in unstaged],
                [p[1] for p in unstaged],
                s=140,
                facecolors="none",
                edgecolors=line.get_color(),
                zorder=3,
                label="pool over its host budget: saved synchronously",
            )
    ax.set_yscale("log")
    ax.set_xlabel("model parameters (billions)")
    ax.set_ylabel("rank 0's peak extra anonymous RSS (MiB, log)")
    ax.set_title("One in-training save (FSDP2, world size 2, CPU)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, f"`make bench` at {save['meta']['commit']}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def timeline_points(train: dict) -> dict[str, list[tuple[float, float]]]:
    """mode -> [(seconds since its first save began, the job's RssAnon in GiB)] at the bench's largest
    size, from a little before that save to its end (or the kill)."""
    meta, pts = train["meta"], {}
    for r in train["rows"]:
        if (
            r["preset"] != meta["preset"]
            or r["mode"] == "verl-resume"
            or r["mode"] in pts
            or "save-1" not in r["events"]
        ):
            continue
        start = r["events"]["save-1"]
        end = r["killed_at_s"] if r["killed"] else r["events"].get("saved-1", start)
        pts[r["mode"]] = [(t - start, v / GIB) for t, v in r["timeline"] if start - 5 <= t <= end + 2]
    return pts


def plot_timeline(train: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {
        "verl": "verl 0.9.1 (hf_model)",
        "intermediate": "+recipe=intermediate",
        "incremental": "+recipe=incremental",
        "stream": "+recipe=incremental, async_save=stream",
    }
    meta = train["meta"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for mode, rows in timeline_points(train).items():
        ax.plot([p[0] for p in rows], [p[1] for p in rows], label=names[mode])
    ax.axhline(meta["cap"] / GIB, color="grey", linestyle="--", label="the cap (the run is killed past it)")
    ax.set_xlabel("seconds since the save began")
    ax.set_ylabel("the job's anonymous RSS (GiB)")
    ax.set_title(f"One save inside verl, {meta['params'] / 1e9:.2f}B model, FSDP2, 2 ranks, CPU", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.text(0.01, 0.01, f"`make bench-train-scale` at {meta['commit']}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=Path, default=DOCS, help="where the JSONs are and the pictures go")
    args = p.parse_args(argv)
    load = lambda name: json.loads((args.docs / name).read_text())  # noqa: E731
    plot_merge(load("bench_merge.json"), load("bench_scale.json"), args.docs / "merge_scale.png")
    plot_save(load("bench_save.json"), args.docs / "save_peak_memory.png")
    wrote = ["merge_scale.png", "save_peak_memory.png"]
    if (args.docs / "bench_train_scale.json").exists():  # written by make bench-train-scale
        plot_timeline(load("bench_train_scale.json"), args.docs / "save_rss_timeline.png")
        wrote.append("save_rss_timeline.png")
    print("wrote " + ", ".join(str(args.docs / name) for name in wrote))


if __name__ == "__main__":
    main()
