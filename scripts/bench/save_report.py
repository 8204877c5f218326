"""The save bench's report: BENCHMARKS.md's save-bench section (table, targets, the async save's phases) from the
measured rows and the run's meta (its --json), and the one way to replace a marked section of a report. Nothing here
runs a save or measures; scripts/bench/save.py does."""

from __future__ import annotations

import math
import os
from pathlib import Path

SIZES = ("0.25b", "0.5b", "1b")
MODES = ("verl", "incremental", "async", "stream")
MODE_LABEL = {
    "verl": "verl 0.9.1 (hf_model)",
    "incremental": "incremental (sync)",
    "async": "incremental (async)",
    "stream": "incremental (async stream)",
}
BEGIN, END = "<!-- save-bench:begin -->", "<!-- save-bench:end -->"
# drawn by `python -m scripts.bench.plots` (make bench) from this table's JSON
PICTURE = "\n![peak extra memory of one save against model size](docs/save_peak_memory.png)\n"


def markers(tag: str = "") -> tuple[str, str]:
    """The report's section markers; a --tag run gets a section of its own beside the full one."""
    return (BEGIN, END) if not tag else (f"<!-- save-bench-{tag}:begin -->", f"<!-- save-bench-{tag}:end -->")


def find(rows: list[dict], size: str, mode: str) -> dict | None:
    return next((r for r in rows if r["size"] == size and r["mode"] == mode), None)


def label(r: dict) -> str:
    if r.get("fsdp", 2) == 1:
        return "verl 0.9.1 FSDP1 (no hf_model)" if r["mode"] == "verl" else f"{MODE_LABEL[r['mode']]}, FSDP1"
    return MODE_LABEL[r["mode"]]


def table(rows: list[dict]) -> str:
    lines = [
        "| model | params | save | peak extra RssAnon (max over ranks) | per rank | wall (median) "
        "| blocking (median) | RSS vs verl | wall vs verl | HF safetensors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in dict.fromkeys(r["size"] for r in rows):
        base = find(rows, size, "verl")
        for r in (x for x in rows if x["size"] == size):
            per_rank = " / ".join(f"{v / 2**20:,.0f}" for v in r["peak_extra_per_rank"])
            vs = "-" if r is base or base is None else f"{base['peak_extra'] / max(r['peak_extra'], 1):.1f}x lower"
            speed = "-" if r is base or base is None else f"{base['wall_s'] / r['wall_s']:.2f}x"
            lines.append(
                f"| {size} | {r['params'] / 1e9:.2f}B | {label(r)} "
                f"| {r['peak_extra'] / 2**20:,.0f} MiB "
                f"| {per_rank} MiB | {r['wall_s']:.1f} s | {r['blocking_s']:.2f} s | {vs} | {speed} "
                f"| {r['hf_safetensors'] or 'none'} |"
            )
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[tuple[str, bool, str]]:
    sizes = sorted(dict.fromkeys(r["size"] for r in rows), key=lambda s: SIZES.index(s))
    big = sizes[-1]
    verl, sync, asyn = (find(rows, big, m) for m in ("verl", "incremental", "async"))
    stream = find(rows, big, "stream")
    checks: list[tuple[str, bool, str]] = []
    if verl and sync:
        exported = bool(sync["export_hf"]) and sync["hf_safetensors"] > 0
        ratio = verl["peak_extra"] / max(sync["peak_extra"], 1)
        checks.append(
            (
                f"per-rank extra peak RssAnon of a save with the HF export >= 10x lower than verl's hf_model "
                f"save ({big})",
                exported and ratio >= 10,
                f"{ratio:.1f}x" + ("" if exported else " (this save had no HF export: export_hf not available)"),
            )
        )
        checks.append(
            (
                f"save wall no worse than verl's ({big}, sync)",
                sync["wall_s"] <= verl["wall_s"],
                f"{sync['wall_s']:.1f} s vs {verl['wall_s']:.1f} s",
            )
        )
    ours = [r for r in (find(rows, s, "incremental") for s in sizes) if r]
    theirs = [r for r in (find(rows, s, "verl") for s in sizes) if r]
    if len(ours) >= 2:
        lo, hi = ours[0]["peak_extra"], ours[-1]["peak_extra"]
        flat = hi <= 1.5 * lo or hi - lo <= 64 * 2**20
        grew = (
            ""
            if len(theirs) < 2
            else f"; verl's grows {theirs[-1]['peak_extra'] / max(theirs[0]['peak_extra'], 1):.1f}x"
        )
        checks.append(
            (
                f"our peak roughly flat from {ours[0]['size']} to {ours[-1]['size']} (at most 1.5x or +64 MiB "
                f"while the model grows {ours[-1]['params'] / ours[0]['params']:.1f}x)",
                flat,
                f"{lo / 2**20:,.0f} -> {hi / 2**20:,.0f} MiB{grew}",
            )
        )
    if asyn and asyn.get("staged") is False:
        # the pool (the rank's whole model + optimizer shard) did not fit this machine's free memory
        # at the largest size: judge the largest size where it did, and say so
        fitted = [s for s in sizes if (find(rows, s, "async") or {}).get("staged") and find(rows, s, "incremental")]
        if fitted:
            big = fitted[-1]
            sync, asyn = find(rows, big, "incremental"), find(rows, big, "async")
    if sync and asyn:
        share = asyn["blocking_s"] / sync["wall_s"]
        how = (
            ""
            if asyn.get("staged", True)
            else " (the staging pool did not fit this machine's free memory: the async save streamed synchronously)"
        )
        if big != sizes[-1]:
            how += f" ({sizes[-1]}: the staging pool did not fit this machine's free memory)"
        checks.append(
            (
                f"async blocking <= 10% of the synchronous save ({big}, median of the saves)",
                share <= 0.10 and asyn.get("staged", True),
                f"{asyn['blocking_s']:.2f} s = {math.ceil(round(1000 * share, 6)) / 10:.1f}% of {sync['wall_s']:.2f} s; first save "
                f"(allocates the pool) {asyn.get('first_blocking_s', asyn['blockings'][0]):.2f} s{how}",
            )
        )
    sync_big = find(rows, sizes[-1], "incremental")
    if stream and stream.get("stream_bound"):
        checks.append(
            (
                f"stream: extra peak RssAnon within the sync bound, write_threads x (bucket_mb + largest shard) "
                f"+ 64 MiB ({sizes[-1]})",
                stream["peak_extra"] <= stream["stream_bound"],
                f"{stream['peak_extra'] / 2**20:,.0f} MiB vs {stream['stream_bound'] / 2**20:,.0f} MiB",
            )
        )
    if stream and sync_big:
        share = stream["blocking_s"] / sync_big["wall_s"]
        checks.append(
            (
                f"stream: blocking <= 2% of the synchronous save ({sizes[-1]}; nothing changes the shards "
                f"before the write ends here: the rollout window is longer than the write)",
                share <= 0.02,
                f"{stream['blocking_s']:.2f} s = {math.ceil(round(1000 * share, 6)) / 10:.1f}% of "
                f"{sync_big['wall_s']:.2f} s",
            )
        )
    return checks


def breakdown(rows: list[dict]) -> str:
    """Where the async save's blocking time goes (rank 0, last save, from the manifest)."""
    lines = []
    for r in rows:
        if r["mode"] != "async" or not r["timings_s"] or not r["timings_s"][-1]:
            continue
        t = r["timings_s"][-1]
        parts = ", ".join(f"{k} {v:.2f} s" for k, v in t.items())
        lines.append(f"- {r['size']}: {parts}")
    return "\n".join(lines)


def render_section(result: dict) -> str:
    rows, meta = result["rows"], result["meta"]
    checks = targets(rows)
    target_lines = ["| target | met | measured |", "|---|---|---|"]
    target_lines += [f"| {name} | {'✓' if ok else '✗'} | {value} |" for name, ok, value in checks]
    no_export = [r for r in rows if r["mode"] != "verl" and not r["export_hf"]]
    note = (
        (
            "\n**These incremental saves ran without the HF export** (this tree's SlimCheckpointConfig refused "
            "export_hf with incremental_save), so they are not yet the save the targets ask for.\n"
        )
        if no_export
        else ""
    )
    begin, end = markers(meta.get("tag", ""))
    title = f" ({meta['tag']})" if meta.get("tag") else ""
    fsdp = meta.get("fsdp", 2)
    verl_saves = (
        "`save_contents: [model, optimizer, extra, hf_model]`"
        if fsdp == 2
        else "`save_contents: [model, optimizer, extra]` (no `hf_model`: FSDP1's full state dict with "
        "offload_to_cpu crashes torch on CPU/gloo)"
    )
    cpu_note = (
        "On CPU verl's sharded save does not copy the shards (they already are host tensors); on GPU it "
        "copies the rank's whole model and optimizer shard to\nhost RAM first, so verl's numbers here are its "
        "lower bound."
        if fsdp == 2
        else "verl's FSDP1 save clones each chunk of its sharded state dicts (on a GPU it moves them to host RAM), "
        "the same on CPU."
    )
    if fsdp == 1:
        target_lines = [
            "FSDP1's sharded state dict is a copy of the rank's shards (slimckpt_testing.gpu_check_fsdp): on "
            "this CPU it lands in host memory, which is what the incremental rows' peak shows; on a GPU "
            'it lands on the device instead (`slimckpt plan`\'s "device added"). The FSDP2 rows of the '
            "same sizes are in the `save-bench` section (FSDP2). Wall per save (spread):"
        ]
        target_lines += [
            f"- {r['size']} {label(r)}: "
            + ", ".join(f"{w:.1f} s" for w in r["walls"])
            + (
                " (state dict "
                + ", ".join(f"{t['state_dict']:.1f} s" for t in r["timings_s"] if t and "state_dict" in t)
                + ")"
                if any(t and "state_dict" in t for t in r["timings_s"])
                else ""
            )
            for r in rows
        ]
    return f"""{begin}
## Save inside verl{title}: FSDP{meta.get("fsdp", 2)}, world size 2, verl 0.9.1's FSDPCheckpointManager

Produced by `{meta["command"]}` on {meta["date"]}{f" at commit {meta['commit']}" if meta.get("commit") else ""}, in {meta["seconds"] / 60:.1f} minutes.
Machine: {meta["machine"]}.
Each row is one fresh `torchrun` (2 ranks, gloo, CPU) that saves the same random model + AdamW state
{meta["repeats"]} time(s). verl: {verl_saves}, verl's own code
(`SLIMCKPT_DISABLE=1`). incremental: `+recipe=incremental` with `export_hf: true` (DCP resume state + the
gather-free HF export, committed by the manifest; the actor checkpoint block of `recipes/incremental.yaml`
as it is); async: the same with `async_save: true` and a staging budget of the machine's free memory.
Peak extra RssAnon: each rank's peak anonymous RSS during its saves above its level before the first save
(sampled every 5 ms from a separate process; the async staging pool is held between saves, so it counts),
largest over ranks. Wall: until every rank's files are committed (async: until the background write is),
median over saves. Blocking: until `save_checkpoint` returns. {cpu_note} slimckpt fsyncs every file before it commits
the step; verl's `torch.save` does not, so part of verl's bytes may still be in the page cache when its save
returns (the page cache is synced before every save, outside the timed window).
{note}
{table(rows)}
{PICTURE if not meta.get("tag") else ""}
### {"Targets (incremental tier)" if fsdp == 2 else "FSDP1"}

{chr(10).join(target_lines)}

Async blocking time, by phase (rank 0, last save, seconds):
{breakdown(rows) or "- (no async rows)"}
{meta.get("note", "")}
{end}
"""


def write_section(section: str, path: Path) -> None:
    """Replace this benchmark's marked section of the report (or append it); the rest of the file
    (scripts/bench/merge.py's merge section) is left as it is."""
    begin, end = section.split("\n", 1)[0], section.rstrip("\n").rsplit("\n", 1)[1]
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1]
        text = head + section.rstrip("\n") + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
