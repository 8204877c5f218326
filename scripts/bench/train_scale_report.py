"""The train-scale bench's report: BENCHMARKS.md's train-scale section (the save and resume tables, the targets) and
README's rows, from the measured rows and the run's meta (its --json). Nothing here runs a save or measures;
scripts/bench/train_scale.py does."""

from __future__ import annotations

from pathlib import Path

GiB, MiB, GB = 2**30, 2**20, 10**9
BEGIN, END = "<!-- train-scale:begin -->", "<!-- train-scale:end -->"
README_BEGIN, README_END = "<!-- train-scale-headline:begin -->", "<!-- train-scale-headline:end -->"
PICTURE = "![the job's anonymous memory during one save](docs/save_rss_timeline.png)"
SAVE_MODES = ("verl", "intermediate", "incremental", "stream")
RESUME_MODES = ("verl-resume", "incremental")
LABEL = {
    "verl": "verl 0.9.1 (`hf_model`)",
    "verl-resume": "verl 0.9.1 (model, extra)",
    "intermediate": "`+recipe=intermediate`",
    "incremental": "`+recipe=incremental`",
    "stream": "`+recipe=incremental`, async_save=stream",
}
# the tier's load holds one bucket of this size per rank (recipes/incremental.yaml's bucket_mb)
LOAD_SLACK = 64 * MiB
SAVE_TARGET = 64 * MiB


def _mib(v: float) -> str:
    return f"{v / MiB:,.0f} MiB"


def when_killed(row: dict) -> str:
    """ "killed 31 s into the save", from the last event the run printed before its kill."""
    during = {"load": "the load", "built": "start-up, after the build", "start-up": "start-up"}.get(
        row["killed_in"], "the save" if row["killed_in"].startswith("save-") else row["killed_in"]
    )
    if row.get("killed_after_s") is None:
        return f"killed {row['killed_at_s']:.0f} s after its start, in {during}"
    return f"killed {row['killed_after_s']:.0f} s into {during}"


def killer(row: dict) -> str:
    return "killed by the kernel's OOM killer" if row.get("killed_by", "the cap").startswith("the kernel") else "cap"


def outcome(row: dict) -> str:
    if row["killed"]:
        return f"{when_killed(row)}, the job's RssAnon at {row['tree_peak'] / GiB:.1f} GiB"
    per_rank = " / ".join(_mib(v) for v in row["save_extra_per_rank"])
    return f"extra {per_rank} (rank 0 / rank 1), wall {row['wall_s']:.1f} s, blocking {row['blocking_s']:.1f} s"


def load_words(row: dict) -> str:
    load = row["load"]
    return (
        f"extra {' / '.join(_mib(v) for v in load['extra_per_rank'])}, wall {load['wall_s']:.1f} s, "
        f"shards {'equal' if load['equal'] else 'DIFFERENT'}"
    )


def find(rows: list[dict], preset: str, mode: str, resume: bool = False) -> dict | None:
    return next(
        (r for r in rows if r["preset"] == preset and r["mode"] == mode and (not resume or "load" in r or r["killed"])),
        None,
    )


def resume_rows(rows: list[dict], preset: str) -> list[dict]:
    return [r for r in rows if r["preset"] == preset and r["mode"] in RESUME_MODES and (r.get("load") or r["killed"])]


def verl_need_words(meta: dict, mode: str, row: dict | None = None) -> str:
    """What verl's path needs on top of the model the ranks hold, from its code: hf_model gathers every
    parameter in fp32 on rank 0; its load torch.loads each rank's whole shard file before copying it in."""
    model = meta["params"] * 4
    load = f"its load reads each rank's whole shard file ({model / 2 / GB:.1f} GB) into memory before copying it in"
    if mode == "verl":
        return f"its `hf_model` save gathers the whole fp32 model ({model / GB:.1f} GB) on rank 0"
    if row is not None and row.get("killed_in", "").startswith("save-"):
        return (
            f"its own save of the files to resume from (`[model, extra]`) did not finish, so its load never ran; {load}"
        )
    return load


def save_table(result: dict) -> str:
    rows, meta = result["rows"], result["meta"]
    lines = [
        "| save | extra RssAnon, rank 0 / rank 1 (peak) | the job's RssAnon (peak) | wall (median) | blocking | HF safetensors | on disk |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in SAVE_MODES:
        r = find(rows, meta["preset"], mode)
        if r is None:
            continue
        if r["killed"]:
            lines.append(
                f"| {LABEL[mode]} | {when_killed(r)}: {verl_need_words(meta, mode, r)} "
                f"| {r['tree_peak'] / GiB:.1f} GiB ({killer(r)}) | - | - | - | - |"
            )
            continue
        lines.append(
            f"| {LABEL[mode]} | {' / '.join(_mib(v) for v in r['save_extra_per_rank'])} | {r['tree_peak'] / GiB:.1f} GiB "
            f"| {r['wall_s']:.1f} s | {r['blocking_s']:.1f} s | {r['hf_safetensors'] or 'none'} | {r['bytes_on_disk'] / GB:.1f} GB |"
        )
    return "\n".join(lines)


def resume_table(result: dict) -> str:
    rows, meta = result["rows"], result["meta"]
    lines = [
        "| model | load | extra RssAnon, rank 0 / rank 1 (peak) | the job's RssAnon (peak) | wall | shards equal to the saved ones |",
        "|---|---|---|---|---|---|",
    ]
    for preset in dict.fromkeys([meta["preset"], meta.get("resume_ref") or meta["preset"]]):
        for r in resume_rows(rows, preset):
            name = f"{preset} ({r['params'] / 1e9:.2f}B)" if r.get("params") else preset
            what = (
                "verl 0.9.1's load of its files"
                if r["mode"] == "verl-resume"
                else "the incremental tier's load of its step"
            )
            if r["killed"]:
                lines.append(
                    f"| {name} | {what} | {when_killed(r)}: {verl_need_words(meta, r['mode'], r)} | {r['tree_peak'] / GiB:.1f} GiB ({killer(r)}) | - | - |"
                )
                continue
            load = r["load"]
            lines.append(
                f"| {name} | {what} | {' / '.join(_mib(v) for v in load['extra_per_rank'])} | {r['tree_peak'] / GiB:.1f} GiB "
                f"| {load['wall_s']:.1f} s | {'yes' if load['equal'] else 'NO'} |"
            )
    return "\n".join(lines)


def targets(result: dict) -> list[tuple[str, bool, str]]:
    rows, meta = result["rows"], result["meta"]
    big = meta["preset"]
    checks = []
    for mode in ("intermediate", "incremental", "stream"):
        r = find(rows, big, mode)
        if r is None:
            continue
        worst = None if r["killed"] else max(r["save_extra_per_rank"])
        checks.append(
            (
                f"{LABEL[mode]} save: extra RssAnon <= 64 MiB per rank ({big})",
                worst is not None and worst <= SAVE_TARGET,
                outcome(r) if worst is None else _mib(worst),
            )
        )
    verl = find(rows, big, "verl")
    if verl:
        checks.append(
            (
                f"verl's `hf_model` save killed or its peak stated ({big})",
                True,
                outcome(verl) if verl["killed"] else f"peak extra {_mib(max(verl['save_extra_per_rank']))}",
            )
        )
    for preset in dict.fromkeys([big, meta.get("resume_ref") or big]):
        ours = next((r for r in resume_rows(rows, preset) if r["mode"] == "incremental"), None)
        theirs = next((r for r in resume_rows(rows, preset) if r["mode"] == "verl-resume"), None)
        if ours is None or ours["killed"]:
            if ours is not None:
                checks.append((f"incremental load finished ({preset})", False, outcome(ours)))
            continue
        worst = max(ours["load"]["extra_per_rank"])
        checks.append(
            (
                f"incremental load: extra RssAnon <= one bucket (64 MiB) + 64 MiB per rank, shards equal ({preset})",
                worst <= 64 * MiB + LOAD_SLACK and ours["load"]["equal"],
                f"{_mib(worst)}, {'equal' if ours['load']['equal'] else 'DIFFERENT'}",
            )
        )
        if theirs is not None:
            ok = theirs["killed"] or ours["load"]["wall_s"] <= theirs["load"]["wall_s"]
            value = (
                f"{ours['load']['wall_s']:.1f} s; verl's load killed"
                if theirs["killed"]
                else f"{ours['load']['wall_s']:.1f} s vs {theirs['load']['wall_s']:.1f} s"
            )
            checks.append((f"incremental load wall <= verl's ({preset})", ok, value))
    return checks


def render_section(result: dict) -> str:
    meta = result["meta"]
    checks = targets(result)
    target_lines = ["| target | met | measured |", "|---|---|---|"]
    target_lines += [f"| {name} | {'✓' if ok else '✗'} | {value} |" for name, ok, value in checks]
    cap_note = f" ({meta['cap_note']})" if meta.get("cap_note") else ""
    return f"""{BEGIN}
## Save and resume inside verl at {meta["params"] / 1e9:.2f}B: FSDP2, world size 2, verl 0.9.1's FSDPCheckpointManager

Produced by `{meta["command"]}` on {meta["date"]} at commit {meta["commit"]}, in {meta["seconds"] / 60:.1f} minutes.
Machine: {meta["machine"]}, {meta["available_gib"]:.1f} GiB available at the end.
A Llama of preset `{meta["preset"]}` ({meta["shape"]}, embeddings untied), random fp32 weights, sharded over two ranks (FSDP2, gloo, CPU): the model alone is
{meta["params"] * 4 / GB:.1f} GB of the host's memory. No optimizer state is saved (AdamW's moments would need
{meta["params"] * 8 / GB:.1f} GB more than this host has): each save is `[model, extra]` (intermediate: its recipe's
`[model]`), the optimizer SGD without momentum. Each row is one fresh `torchrun`, its process tree killed as
soon as its summed anonymous RSS passes {meta["cap"] / GiB:.1f} GiB{cap_note}, as the OOM killer would. Extra RssAnon: each
rank's peak during the save (or load) above its level just before it, sampled every 5 ms from a separate
process; the job's RssAnon: the whole tree's (ranks, torchrun, samplers), model included. Saves per run:
{meta["repeats"]}; wall until every rank's files are committed. verl runs its own code (`SLIMCKPT_DISABLE=1`).

{save_table(result)}

Resume: after its last save, each run scrambles its shards and loads the step back; the loads read from
disk (the step's files dropped from the page cache first), and every rank's shards are compared byte for
byte with the saved ones after the load. The incremental tier's load checksums every file of the step
before it reads it (`verify: true`, the recipe's default), so it reads the step from disk twice; verl's
load reads its files once and checks nothing.

{resume_table(result)}

{PICTURE}

### Targets

{chr(10).join(target_lines)}
{END}
"""


def headline(result: dict) -> str:
    """README's rows at this size."""
    rows, meta = result["rows"], result["meta"]
    big, size = meta["preset"], f"{meta['params'] / 1e9:.2f}B"
    verl, ours = find(rows, big, "verl"), find(rows, big, "incremental")
    link = (
        "[BENCHMARKS.md](BENCHMARKS.md#save-and-resume-inside-verl-at-"
        + size.replace(".", "").lower()
        + "-fsdp2-world-size-2-verl-091s-fsdpcheckpointmanager)"
    )
    lines = [
        f"| inside training (`make bench-train-scale`, {meta['date']}; FSDP2, model and extra state) | verl 0.9.1 | slimckpt |",
        "|---|---|---|",
    ]
    if verl and ours and not ours["killed"]:
        theirs = (
            f"{when_killed(verl)} at {verl['tree_peak'] / GiB:.0f} GiB for the job (`hf_model`)"
            if verl["killed"]
            else f"{_mib(verl['save_extra_per_rank'][0])}, {verl['wall_s']:.1f} s (`hf_model`)"
        )
        lines.append(
            f"| save with a Hugging Face export, {size} model, 2 ranks: extra host memory of rank 0, save time ({link}) "
            f"| {theirs} | {_mib(ours['save_extra_per_rank'][0])}, {ours['wall_s']:.1f} s (`+recipe=incremental`) |"
        )
    theirs = next((r for r in resume_rows(rows, big) if r["mode"] == "verl-resume"), None)
    if ours and ours.get("load") and theirs:
        verl_words = (
            f"{when_killed(theirs)} at {theirs['tree_peak'] / GiB:.0f} GiB for the job"
            if theirs["killed"]
            else f"{_mib(theirs['load']['extra_per_rank'][0])}, {theirs['load']['wall_s']:.1f} s"
        )
        lines.append(
            f"| resume the {size} model from its last step: extra host memory of rank 0, load time ({link}) "
            f"| {verl_words} | {_mib(ours['load']['extra_per_rank'][0])}, {ours['load']['wall_s']:.1f} s |"
        )
    return "\n".join(lines)


def write_readme(result: dict, path: Path) -> None:
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise SystemExit(f"[bench-train-scale] {path} has no {README_BEGIN} ... {README_END} markers for its rows")
    head, rest = text.split(README_BEGIN, 1)
    tail = rest.split(README_END, 1)[1]
    path.write_text(f"{head}{README_BEGIN}\n{headline(result)}\n{README_END}{tail}")
