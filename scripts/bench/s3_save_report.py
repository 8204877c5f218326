"""The S3 save bench's report: BENCHMARKS.md's s3-save section (per target: walls, GB/s, CPU seconds, memory against
its bound; the targets), from the measured rows and the run's meta (its --json). Nothing here runs a save, a server
or measures; scripts/bench/s3_save.py does."""

from __future__ import annotations

import re
import statistics

MiB, GiB, GB = 2**20, 2**30, 10**9
BEGIN, END = "<!-- s3-save:begin -->", "<!-- s3-save:end -->"
TARGETS = ("disk", "s3")
BIG = "llama3.2-3b"
SLACK = 64 * MiB  # the engine's own streaming allowance, the same for both targets
RATIO_TARGET = 1.25


def bound(part_bytes: int, concurrency: int, write_threads: int) -> int:
    """What a rank may add during an upload: its parts (a per-process pool of concurrency - 1 uploading,
    plus one being filled per open stream, at most write_threads of them: within part x concurrency x
    write_threads) and the engine's own 64 MiB."""
    return part_bytes * concurrency * write_threads + SLACK


def summarise(result: dict) -> dict:
    """Per target: walls (median, min, max), GB/s, worst rise per rank; the ratio s3/disk; the bound."""
    meta, rows = result["meta"], result["rows"]
    out: dict = {"targets": {}}
    for target in TARGETS:
        mine = [r for r in rows if r["target"] == target and r["preset"] == meta["preset"]]
        if not mine:
            continue
        walls = [r["wall_s"] for r in mine]
        med = statistics.median(walls)
        nbytes = statistics.median(r["bytes"] for r in mine)
        ranks = len(mine[0]["rise_per_rank"])
        entry = {
            "runs": len(mine),
            "median_s": med,
            "min_s": min(walls),
            "max_s": max(walls),
            "bytes": nbytes,
            "gbps": nbytes / med / GB if med else 0.0,
            "rise_per_rank": [max(r["rise_per_rank"][i] for r in mine) for i in range(ranks)],
            "tree_peak": max(r["tree_peak"] for r in mine),
            "cpu_s": statistics.median(r.get("ranks_cpu_s", 0.0) + (r.get("server_cpu_s") or 0.0) for r in mine)
            if all("ranks_cpu_s" in r for r in mine)
            else None,
            "server_cpu_s": statistics.median(r["server_cpu_s"] for r in mine)
            if all(r.get("server_cpu_s") is not None for r in mine)
            else None,
            "params": mine[0]["params"],
        }
        if target == "s3":
            first = mine[0]
            entry["bound"] = bound(first["part_bytes"], first["concurrency"], first["write_threads"])
            entry["server_peak"] = max(r.get("server_peak") or 0 for r in mine)
            entry["connect_rise"] = max(max(r.get("connect_rise_per_rank") or [0]) for r in mine)
            entry["connect_s"] = statistics.median(r.get("connect_s", 0.0) for r in mine)
        else:
            entry["bound"] = SLACK
        entry["within"] = max(entry["rise_per_rank"]) <= entry["bound"]
        out["targets"][target] = entry
    disk, s3 = out["targets"].get("disk"), out["targets"].get("s3")
    out["ratio"] = s3["median_s"] / disk["median_s"] if disk and s3 and disk["median_s"] else None
    return out


def _mib(v: float) -> str:
    return f"{v / MiB:,.0f} MiB"


def wall_words(e: dict) -> str:
    if e["runs"] == 1:
        return f"{e['median_s']:.1f} s (1 run)"
    return f"{e['median_s']:.1f} s ({e['min_s']:.1f}–{e['max_s']:.1f}, {e['runs']} runs)"


def cpu_words(e: dict) -> str:
    """The ranks' and (S3) the server's CPU seconds during a row: where a host's cores went."""
    if e.get("cpu_s") is None:
        return "-"
    if e.get("server_cpu_s") is None:
        return f"{e['cpu_s']:.0f} (ranks)"
    ranks = e["cpu_s"] - e["server_cpu_s"]
    return f"{e['cpu_s']:.0f} (ranks {ranks:.0f}, server {e['server_cpu_s']:.0f})"


def cores_of(meta: dict) -> int | None:
    if meta.get("cores"):
        return int(meta["cores"])
    found = re.search(r"(\d+) cores", meta.get("machine", ""))
    return int(found.group(1)) if found else None


def where_time_went(result: dict) -> str:
    """One sentence when the S3 rows kept the host's cores busy: their time was CPU, mostly the server's."""
    meta, summary = result["meta"], summarise(result)
    s3, cores = summary["targets"].get("s3"), cores_of(meta)
    if not s3 or s3.get("server_cpu_s") is None or not cores:
        return ""
    busy = s3["cpu_s"] / (cores * s3["median_s"])
    return (
        f" The S3 rows kept the host's {cores} cores {busy:.0%} busy; the server alone spent"
        f" {s3['server_cpu_s'] / (s3['bytes'] / GB):.1f} CPU seconds per GB stored (the ranks"
        f" {(s3['cpu_s'] - s3['server_cpu_s']) / (s3['bytes'] / GB):.1f}), so on this host the upload's time is the"
        f" server's CPU: at least {s3['server_cpu_s'] / cores:.0f} s with every core on it."
    )


def table(result: dict) -> str:
    summary = summarise(result)
    lines = [
        "| target | wall until durable (median, min–max) | GB/s | s3 / disk | CPU seconds (median) | extra RssAnon, rank 0 / rank 1 (peak) | bound per rank | within |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for target, e in summary["targets"].items():
        ratio = f"{summary['ratio']:.2f}x" if target == "s3" and summary["ratio"] is not None else "-"
        what = "local disk (fsync)" if target == "disk" else "S3, local SeaweedFS"
        bound_words = _mib(e["bound"]) + (" (the engine's own)" if target == "disk" else "")
        lines.append(
            f"| {what} | {wall_words(e)} | {e['gbps']:.2f} | {ratio} | {cpu_words(e)} | {' / '.join(_mib(v) for v in e['rise_per_rank'])} "
            f"| {bound_words} | {'yes' if e['within'] else 'NO'} |"
        )
    return "\n".join(lines)


def targets(result: dict) -> list[tuple[str, bool, str]]:
    meta, summary = result["meta"], summarise(result)
    checks = []
    s3 = summary["targets"].get("s3")
    if summary["ratio"] is not None:
        name = f"time until the step is durable on S3 <= {RATIO_TARGET}x the same write to disk ({meta['preset']})"
        if meta["preset"] != BIG:
            name += f"; the target is stated at {BIG}"
        checks.append((name, summary["ratio"] <= RATIO_TARGET, f"{summary['ratio']:.2f}x"))
    if s3:
        checks.append(
            (
                "extra RssAnon per rank during the upload <= part x concurrency x write_threads + 64 MiB",
                s3["within"],
                f"{_mib(max(s3['rise_per_rank']))} <= {_mib(s3['bound'])}"
                if s3["within"]
                else f"{_mib(max(s3['rise_per_rank']))} > {_mib(s3['bound'])}",
            )
        )
    return checks


def render_section(result: dict) -> str:
    meta, summary = result["meta"], summarise(result)
    any_row = next(iter(summary["targets"].values()))
    params = any_row["params"]
    nbytes = any_row["bytes"]
    s3 = summary["targets"].get("s3") or {}
    write_threads = next((r["write_threads"] for r in result["rows"]), 1)
    pairs = max(e["runs"] for e in summary["targets"].values())
    runs = f"{pairs} pairs of rows (disk, s3, disk, s3, ...)" if pairs > 1 else "one row per target (disk, then s3)"
    if not meta.get("done", True):
        runs += f", cut short: {len(result['rows'])} of the {2 * meta['repeat']} rows planned ran"
    repeat_note = f" {meta['repeat_note']}" if meta.get("repeat_note") else ""
    cap_note = f" ({meta['cap_note']})" if meta.get("cap_note") else ""
    server = f" The server's own peak RssAnon: {_mib(s3['server_peak'])}." if s3.get("server_peak") else ""
    if "connect_rise" in s3:
        server += (
            f" Before the save's window each rank makes its S3 client (boto3 imported, the bucket checked) and"
            f" writes one object of a part and a MiB (a multipart upload of two parts) beside the step and"
            f" removes it, as a run's first save would: that costs {_mib(s3['connect_rise'])} per rank at most"
            f" ({s3['connect_s']:.1f} s), once per process, and is not in the table."
        )
    checks = "\n".join(f"| {n} | {'✓' if ok else '✗'} | {v} |" for n, ok, v in targets(result))
    return f"""{BEGIN}
## One incremental step to local disk and to S3 at {params / 1e9:.2f}B, through the engine

Produced by `{meta["command"]}` on {meta["date"]} at commit {meta["commit"]}, in {meta["seconds"] / 60:.1f} minutes.
Machine: {meta["machine"]}, {meta["available_gib"]:.1f} GiB available at the end.
Preset `{meta["preset"]}` ({params / 1e9:.2f}B parameters, random fp32 weights, FSDP2 over two ranks, gloo, CPU):
one `save_resume_state` of `[model, extra]`, `recipe=incremental`, synchronous, no HF export: {nbytes / GB:.2f} GB
per step. Each row is one fresh `torchrun` (its tree capped at {meta["cap"] / GiB:.1f} GiB{cap_note}); {runs}.{repeat_note}
disk: a fresh dir on the local disk, fsynced, deleted after. S3: a fresh SeaweedFS (`weed mini`) per row with
its data on the same disk, stopped and its dir deleted after; SeaweedFS does not fsync what it stores, so
"durable" there means every upload completed and the manifest's conditional PUT answered. S3 settings:
part {meta["part_bytes"] / MiB:.0f} MiB, concurrency {meta["concurrency"]}, write_threads {write_threads}
(the backend's defaults unless the command says otherwise). Wall: from a barrier before the save to the barrier
after every rank's save returned (the step committed). Extra RssAnon: each rank's peak during the save above
its level just before it, sampled every 5 ms from a separate process. CPU seconds: the ranks' (user and
system, every thread) during the save, and the server's over its row; the host's cores are shared by both. The bound per rank is part x
concurrency x write_threads + 64 MiB: by the backend's design a writing process holds concurrency - 1 parts uploading and one being
filled per open stream (at most write_threads), and the engine's streaming needs 64 MiB whatever the target.{server}

{table(result)}

{where_time_went(result).strip()}

| target | met | measured |
|---|---|---|
{checks}
{END}
"""
