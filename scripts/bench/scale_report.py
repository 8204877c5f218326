"""The scale bench's report: BENCHMARKS.md's scale section (the table of the two merges and verl's, the targets,
where the single merge's wall went, a merge killed midway) and README's headline row, from a run's JSON (its --json),
and the I/O floor each row is held to, worked out from the run's own disk measurements. Nothing here runs a merge or
measures; scripts/bench/scale.py does."""

from __future__ import annotations

import re
import textwrap

from scripts.bench.merge_report import floor_ratio
from slimckpt.engine.writer_stats import WriterStats
from slimckpt.observe.diskspeed import DiskSpeed, fastest_of
from slimckpt.observe.measure import median

BEGIN, END = "<!-- scale-bench:begin -->", "<!-- scale-bench:end -->"
README_BEGIN, README_END = "<!-- scale-headline:begin -->", "<!-- scale-headline:end -->"
# drawn by `python -m scripts.bench.plots` (make bench-scale) from the bench and scale JSONs
PICTURE = "![merge peak memory and wall against model size, with the I/O floor](docs/merge_scale.png)"
SINGLE, DISTRIBUTED = "slimckpt merge", "slimckpt merge --distributed_merge"
GiB, MiB, GB = 2**30, 2**20, 1e9
# wall over the I/O floor each merge is held to: two ranks on one host share its disk, and each starts
# its own Python and torch, so the distributed merge's target is looser than the single one's
WALL_TARGETS = {SINGLE: 1.3, DISTRIBUTED: 1.5}
FLOOR = "the faster of the page cache and O_DIRECT"


def refloor(result: dict) -> dict:
    """Every row's I/O floor from the run's own disk measurements; also brings a run recorded with an
    earlier definition of the floor (O_DIRECT alone, before the merge read through the page cache)
    to this one."""
    disks = [DiskSpeed(**d) for d in result["disk_measurements"]]
    for row in result["rows"]:
        row["io_floor_s"] = io_floor_s(disks, row["read_bytes"], row["written_bytes"])
    result["floor"] = FLOOR
    return result


def io_floor_s(disks: list[DiskSpeed], read_bytes: int, written_bytes: int) -> float:
    """Bytes read at the best read speed of the run plus bytes written at its best write speed, each
    the faster of the page cache and O_DIRECT: what the disk can do, whichever path gets it (the
    merge goes through the page cache, which read 3x faster than one O_DIRECT request at a time on
    the host measured)."""
    return fastest_of(disks).io_floor_s(read_bytes, written_bytes)


def left_looks_incomplete(found: dict) -> bool:
    """Nothing a user or a loader would take for a finished merge: no output dir, no manifest in the
    partial one, and `slimckpt verify` refusing the output path."""
    return (
        found["killed"]
        and not found["target_exists"]
        and not found["partial_manifest"]
        and found["verify_after_kill"]["returncode"] != 0
    )


def rerun_recovers(found: dict) -> bool:
    return (
        found["rerun_returncode"] == 0
        and not found["partial_after_rerun"]
        and found["verify_after_rerun"]["returncode"] == 0
    )


def _span(values: list[float], fmt: str) -> str:
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def verl_needs(result: dict) -> float:
    """Bytes verl's merger needs at this size: its peak when it finished under the cap; when killed,
    its peak per shard byte on the smaller checkpoint times these shards."""
    if not result["verl"]["killed"]:
        return result["verl"]["peak_rss_anon"]
    return result["verl_reference"]["per_shard_byte"] * result["build"]["shard_bytes"]


def verl_words(result: dict) -> str:
    verl, ref, built = result["verl"], result["verl_reference"], result["build"]
    cap = result["verl_cap"]
    if verl["killed"]:
        got = (
            f"killed at {verl['killed_at_s']:.0f} s when its anonymous RSS passed {cap / GiB:.1f} GiB, having "
            f"loaded {verl['shards_loaded']} of {built['files']} rank files completely and read "
            f"{verl['read_bytes'] / GB:.1f} of their {built['shard_bytes'] / GB:.1f} GB; it wrote "
            f"{verl['wrote_bytes'] / GB:.1f} GB"
        )
    else:
        got = (
            f"not killed: it finished in {verl['wall_s']:.0f} s at a peak of {verl['peak_rss_anon'] / GiB:.1f} GiB "
            f"(exit {verl['returncode']})"
        )
    return (
        f"verl's merger (`python -m verl.model_merger merge --backend fsdp`, `SLIMCKPT_DISABLE=1`) was {got}. "
        f"Merged without a cap in the same run, the {ref['preset']} checkpoint at the same world size "
        f"({ref['shard_bytes'] / GB:.1f} GB of shards) took it {ref['wall_s']:.1f} s at a peak of "
        f"{ref['peak_rss_anon'] / GiB:.2f} GiB, {ref['per_shard_byte']:.2f}x its shards: at that rate the "
        f"{result['preset']} merge needs {ref['per_shard_byte'] * built['shard_bytes'] / GiB:.1f} GiB of anonymous "
        f"memory"
        + (
            "."
            if verl["killed"]
            else f" (it held {verl['peak_rss_anon'] / GiB:.1f} GiB, "
            f"{verl['peak_rss_anon'] / built['shard_bytes']:.2f}x its shards)."
        )
    )


def table(result: dict) -> str:
    head = ["tool", "runs", "peak RssAnon", "wall (median)", "walls", "I/O floor", "wall / floor", "output checked"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        check = r.get("check") or {}
        checked = (
            f"{check['tensors']} tensors equal"
            if check.get("ok")
            else f"**{len(check.get('problems') or [])} problems**"
            if check
            else "not checked"
        )
        lines.append(
            "| "
            + " | ".join(
                [
                    r["tool"] + (f" ({result['workers']} ranks)" if r["tool"] == DISTRIBUTED else ""),
                    str(len(r["walls"])),
                    f"{max(r['peaks']) / MiB:,.0f} MiB",
                    f"{median(r['walls']):.1f} s",
                    _span(r["walls"], ".1f") + " s",
                    f"{r['io_floor_s']:.1f} s",
                    floor_ratio(median(r["walls"]), r["io_floor_s"]),
                    checked,
                ]
            )
            + " |"
        )
    verl = result["verl"]
    lines.append(
        "| "
        + " | ".join(
            [
                "verl 0.9.1",
                "1",
                f"{verl['peak_rss_anon'] / MiB:,.0f} MiB" + (" (killed)" if verl["killed"] else ""),
                f"killed at {verl['killed_at_s']:.0f} s" if verl["killed"] else f"{verl['wall_s']:.1f} s",
                "-",
                "-",
                "-",
                f"needs {verl_needs(result) / GiB:.1f} GiB" if verl["killed"] else "finished under the cap",
            ]
        )
        + " |"
    )
    return "\n".join(lines)


def targets(result: dict) -> str:
    checks = []
    for r in result["rows"]:
        peak, ratio = max(r["peaks"]), median(r["walls"]) / r["io_floor_s"]
        limit = WALL_TARGETS.get(r["tool"], 1.3)
        checks.append((f"{r['tool']}: peak RssAnon at most 300 MiB", peak <= 300 * MiB, f"{peak / MiB:.0f} MiB"))
        spread = f"{floor_ratio(min(r['walls']), r['io_floor_s'])}-{floor_ratio(max(r['walls']), r['io_floor_s'])}"
        checks.append(
            (
                f"{r['tool']}: wall at most {limit}x the I/O floor",
                ratio <= limit,
                f"{floor_ratio(median(r['walls']), r['io_floor_s'])} (runs {spread})",
            )
        )
        check = r.get("check") or {}
        checks.append(
            (
                f"{r['tool']}: output equal to the shards, tensor for tensor",
                bool(check.get("ok")),
                f"{check.get('tensors', 0)} tensors, {check.get('elements', 0) / 1e9:.2f}B elements",
            )
        )
    midway = result.get("killed_midway")
    if midway:
        checks.append(
            (
                f"{SINGLE} killed midway: leaves nothing that looks complete",
                left_looks_incomplete(midway),
                f"killed at {midway['killed_at_s'] or 0:.0f} s; `slimckpt verify` exit "
                f"{midway['verify_after_kill']['returncode']}",
            )
        )
        checks.append(
            (
                f"{SINGLE} killed midway: the same command again finishes and verifies",
                rerun_recovers(midway),
                f"{midway['rerun_wall_s']:.0f} s, `slimckpt verify` exit {midway['verify_after_rerun']['returncode']}",
            )
        )
    lines = ["| target | met | measured |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if ok else '**no**'} | {value} |" for name, ok, value in checks]
    return "\n".join(lines)


def render_section(result: dict) -> str:
    built, disk = result["build"], DiskSpeed(**result["disk"])
    disks = [DiskSpeed(**d) for d in result["disk_measurements"]]
    read_speed, write_speed = disk.read_bytes_per_s, disk.write_bytes_per_s
    rows = {r["tool"]: r for r in result["rows"]}
    dist = rows.get(DISTRIBUTED)
    cap_words = f" ({result['verl_cap_note']})" if result.get("verl_cap_note") else ""
    loads = [x for r in result["rows"] for x in r["loads"]]
    commit = result.get("commit") or "unknown"
    commit += " with uncommitted changes" if result.get("dirty") else ""
    return f"""{BEGIN}
## At scale: {_shape_words(result)} (fp32, world size {result["world_size"]}), merged on this host

`{result["command"]}` (`make bench-scale`), commit {commit}, {result["date"]}, in {result["seconds"] / 60:.1f} minutes;
{result.get("machine", "")}. {result["free_disk_gib"]:.0f} GiB of disk free and {result["mem_available_gib"]:.1f} GiB of
memory available as it started; the 1-minute load average was {result["load_start"]:.1f} at the start,
{_span(loads, ".1f")} as the merges started (the host is shared) and {result["load_end"]:.1f} at the end.

The checkpoint: {built["params"] / 1e9:.2f}B parameters (preset `{result["preset"]}` of
`slimckpt_testing.verl_checkpoints.fsdp_checkpoint`, a Llama with untied embeddings), {built["files"]} rank files of {built["shard_bytes"] / GB:.1f} GB, model only, written in
{built["wall_s"]:.0f} s by `slimckpt_testing.verl_checkpoints.fake_pg_checkpoint` (one rank at a time over torch's fake process
group from a meta model, each rank's shards saved by verl's own `FSDPCheckpointManager`; the builder's peak
was {built["peak_rss_anon"] / GiB:.1f} GiB, one rank's shards). Peak RssAnon is sampled from outside every
10 ms (the merge's process, shared pages counted once; for the distributed merge the largest
rank, its launcher left out, and {max(dist["tree_peaks"]) / MiB:,.0f} MiB for the whole torchrun tree).
The I/O floor is {built["shard_bytes"] / GB:.1f} GB read at {read_speed / GB:.2f} GB/s plus the
output written at {write_speed / GB:.2f} GB/s: {result["floor"]}, at its best over the
run's {len(disks)} disk measurements (`slimckpt.observe.diskspeed`: {"; ".join(d.describe() for d in disks)}).{_mixed_words(result)}{_writer_words(result)} Each output was checked tensor for
tensor against the shards, one tensor at a time (`python -m slimckpt_testing.merge_check`, with the last
run's output).

{table(result)}

{PICTURE}

{_wrap(verl_words(result))}
The cap stands for this host's memory: {result["verl_cap"] / GiB:.1f} GiB{cap_words}; the documented default
(`--verl-cap-gib`) is 18 GiB.
{_midway_words(result)}
{targets(result)}
{_note(result)}{END}
"""


def _mixed_words(result: dict) -> str:
    """The floor adds a read and a write each at its own best; a merge reads and writes at once,
    and on a disk that does both at once more slowly than either alone, that is what bounds it."""
    mixed = [d["mixed_bytes_per_s"] for d in result["disk_measurements"] if d.get("mixed_bytes_per_s")]
    single = next((r for r in result["rows"] if r["tool"] == SINGLE), None)
    if not mixed or single is None:
        return ""
    moved = single["read_bytes"] + single["written_bytes"]
    at_best = moved / max(mixed)
    return (
        f" Read and written at once, as a merge does, the disk moved {_span([m / GB for m in mixed], '.2f')} GB/s"
        f" combined: the merge's {moved / GB:.1f} GB of reads and writes at the best of those take"
        f" {at_best:.0f} s, {at_best / single['io_floor_s']:.2f}x the I/O floor, where {SINGLE} took"
        f" {median(single['walls']):.0f} s (median)."
    )


def _writer_words(result: dict) -> str:
    """Where the single merge's wall went, from its writer's own timings: the casts (one thread, the
    reads of the rank files being its page faults) against a cold read alone in the same run, the last
    writes and fsyncs, and what is neither (starting Python, the imports, the plan, the commit)."""
    single = next((r for r in result["rows"] if r["tool"] == SINGLE), None)
    runs = [WriterStats.from_dict(d) for d in (single or {}).get("writer_stats", [])]
    if not runs or len(runs) != len(single["walls"]):
        return ""
    read = single["read_bytes"]
    cold = max(d["buffered_read_bytes_per_s"] for d in result["disk_measurements"])
    outside = [wall - w.wall_s for wall, w in zip(single["walls"], runs)]
    return (
        f" Where {SINGLE}'s wall went (its writer's timings, `SLIMCKPT_MERGE_STATS`): the writer ran"
        f" {_span([w.wall_s for w in runs], '.1f')} s of it; casting to the output dtype on one thread, the reads"
        f" of the rank files being its page faults, took {_span([w.cast_s for w in runs], '.1f')} s"
        f" ({_span([read / w.cast_s / GB for w in runs], '.2f')} GB/s of rank files, where a cold read alone"
        f" moved {cold / GB:.2f} GB/s at best), the writes overlapping it; the last writes and fsyncs after the"
        f" last chunk {_span([w.close_s for w in runs], '.1f')} s; starting Python, importing torch and"
        f" transformers, planning and the commit the other {_span(outside, '.1f')} s."
    )


def _midway_words(result: dict) -> str:
    """What a merge killed midway left: nothing when an earlier run did not try it."""
    m = result.get("killed_midway")
    if not m:
        return ""
    if not m["killed"]:
        return f"\nThe merge meant to be killed {m['kill_after_s']:.0f} s in finished before that.\n"
    target, partial = "`<target>`", "`<target>.partial/`"
    left = (
        f"{partial} with {m['partial_files']} files ({m['partial_bytes'] / GB:.1f} GB) "
        + ("and a manifest" if m["partial_manifest"] else "and no manifest")
        if m["partial_files"]
        else f"no {partial}"
    )
    target_words = f"{target} exists" if m["target_exists"] else f"no {target}"
    again = (
        f"The same command run again (no `--overwrite`) took {m['rerun_wall_s']:.0f} s, "
        + ("left no partial dir" if not m["partial_after_rerun"] else f"left {partial} behind")
        + f", and `slimckpt verify` of its output exited {m['verify_after_rerun']['returncode']}."
    )
    said = m["verify_after_kill"]["said"].replace("`", "'")
    return (
        "\n"
        + _wrap(
            f"A merge killed midway: `{SINGLE}` SIGKILLed {m['killed_at_s']:.0f} s into its run (half its median "
            f"wall) left {target_words} and {left}; `slimckpt verify <target>` exited "
            f'{m["verify_after_kill"]["returncode"]} ("{said}"). {again}'
        )
        + "\n"
    )


def _note(result: dict) -> str:
    return f"\n{_wrap(result['note'])}\n" if result.get("note") else ""


# the run README's headline quotes: a model of the size people train, not one the 1B rows already show
HEADLINE_PARAMS = 7e9
SHAPES = {"llama3-8b": "a Llama-3-8B-shaped checkpoint", "llama3.2-3b": "a Llama-3.2-3B-shaped checkpoint"}


def _shape_words(result: dict) -> str:
    return SHAPES.get(result["preset"], f"a {result['build']['params'] / 1e9:.2f}B Llama checkpoint")


def _anchor(result: dict) -> str:
    """GitHub's anchor of the section's heading."""
    heading = f"At scale: {_shape_words(result)} (fp32, world size {result['world_size']}), merged on this host"
    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")


def _wrap(text: str) -> str:
    return "\n".join(textwrap.wrap(text, width=110, break_long_words=False, break_on_hyphens=False))


def readme_block(result: dict) -> str | None:
    """README's headline row; None for a run below the headline's size (its section is in BENCHMARKS.md only)."""
    if result["build"]["params"] < HEADLINE_PARAMS:
        return None
    rows = {r["tool"]: r for r in result["rows"]}
    ours = rows[SINGLE]
    verl = result["verl"]
    size = f"{result['build']['params'] / 1e9:.1f}"
    verl_cell = (
        f"killed at {verl['peak_rss_anon'] / GiB:.0f} GiB after {verl['killed_at_s']:.0f} s (needs "
        f"{verl_needs(result) / GiB:.0f} GiB)"
        if verl["killed"]
        else f"{verl['peak_rss_anon'] / GiB:.1f} GiB, {verl['wall_s']:.0f} s"
    )
    return "\n".join(
        [
            README_BEGIN,
            f"**At scale** (`make bench-scale`, {result['date']}; [BENCHMARKS.md](BENCHMARKS.md#{_anchor(result)})):",
            "",
            "| job | verl 0.9.1 | slimckpt |",
            "|---|---|---|",
            f"| merge {_article(size)} {size}B checkpoint (fp32, world size {result['world_size']}, "
            f"{result['build']['shard_bytes'] / GB:.0f} GB) to HF | {verl_cell} | {max(ours['peaks']) / MiB:.0f} MiB, "
            f"{median(ours['walls']):.0f} s ({floor_ratio(median(ours['walls']), ours['io_floor_s'])} the I/O floor"
            f"{_load_words(ours)}), every tensor equal to the shards |",
            README_END,
        ]
    )


def _article(number: str) -> str:
    """English's article before a number read aloud: an 8.0B, an 11B, a 3.2B."""
    return "an" if number.startswith(("8", "11", "18")) else "a"


def _load_words(row: dict) -> str:
    """The 1-minute load average as the merges started: what else the host ran meanwhile."""
    loads = row.get("loads") or []
    return f", load {_span(loads, '.0f')}" if loads else ""
