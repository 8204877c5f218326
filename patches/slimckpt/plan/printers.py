"""The plan as tables: `slimckpt plan`'s report, and the dry run's (slimckpt.plan.dryrun), from the
dict slimckpt.plan.build.build_report makes (the same dict `--json` prints)."""

from __future__ import annotations

import sys
from typing import Any

from slimckpt.plan.cost import human


def print_report(r: dict[str, Any], out=sys.stdout) -> None:
    w = r["world_size"]
    print(
        f"model: {r['config']}: {r['parameters']:,} parameters, fp32 {human(r['fp32_model_bytes'])}"
        + (f", tied: {', '.join(r['tied'])}" if r["tied"] else ""),
        file=out,
    )
    split = r.get("split_on_save") or {}
    if split.get("fused_tensors"):
        print(
            f"fused MoE experts: {split['fused_tensors']} tensors, split into {split['outputs']} per-expert tensors "
            f"in the HF export (as save_pretrained writes them)",
            file=out,
        )
    if r.get("vision_parameters"):
        print(f"vision tower: {r['vision_parameters']:,} parameters (sharded and exported with the rest)", file=out)
    lora = r.get("lora")
    if lora:
        print(
            f"LoRA rank {lora['rank']} (alpha {lora['alpha']:g}) on {lora['modules']} modules ({lora['keys']}, as peft "
            f"wraps them): "
            f"{lora['parameters']:,} trainable parameters; the base is frozen (AdamW state only for the adapter); "
            f"the export adds lora_adapter/ ({human(lora['adapter_bytes'])})",
            file=out,
        )
    print(
        f"FSDP{r['fsdp']}, world size {w}: rank 0 holds {human(r['rank0_model_shard_bytes'])} of model and "
        f"{human(r['rank0_optimizer_shard_bytes'])} of AdamW state; largest tensor shard "
        f"{human(r['largest_tensor_shard_bytes'])}; extra state ~{human(r['extra_bytes_per_rank'])} per rank",
        file=out,
    )
    bw = r["disk_gbps"]
    s3 = r.get("s3")  # --storage s3 only: a POSIX plan prints as it always has
    head = [
        "strategy",
        "rank 0 writes",
        "all ranks write",
        "HF export",
        "host memory / rank",
        f"time @{bw:g} GB/s" if bw else "time",
        *([f"S3 durable @{s3['upload_gbps']:g} GB/s"] if s3 else []),
        "training blocked for",
    ]
    rows = [
        [
            e["strategy"],
            human(e["rank0_write_bytes"]),
            human(e["total_write_bytes"]),
            human(e["hf_export_bytes"]) if e["hf_export_bytes"] else "-",
            human(e["host_peak_bytes"]),
            f"{e['write_seconds']:.1f} s" if e["write_seconds"] is not None else "(--disk-gbps)",
            *([durable_cell(e["s3"])] if s3 else []),
            e["blocking"],
        ]
        for e in r["estimates"]
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head, ["-" * n for n in widths], *rows]:
        print("  ".join(str(x).ljust(n) for x, n in zip(row, widths)).rstrip(), file=out)
    writer = r.get("writer") or {}
    alone = [e["strategy"] for e in r["estimates"] if e["export_by_rank0"] and e["write_seconds"] is not None]
    if alone and writer.get("gbps"):
        print(
            f"time: {', '.join(alone)}: the export is written by rank 0 alone after the shards, at "
            f"{writer['gbps']:g} GB/s ({writer['source']}; --writer-gbps sets it); the gather before it is not timed",
            file=out,
        )
    print("host memory:", file=out)
    for e in r["estimates"]:
        print(f"  {e['strategy']}: {e['host_note']}" + "".join(f"; {n}" for n in e["notes"]), file=out)
    print_s3(r, out)
    print_stream(r, out)
    print_node(r, out)
    print_peak_disk(r, out)
    print_retention_disk(r, out)
    print_resume_times(r, out)
    hf = r["hf_export"]
    files = hf["files"]
    print(
        f"HF export ({hf['dtype']}, max_shard_size {hf['max_shard_size']}): {len(files)} file(s), {human(hf['bytes'])}",
        file=out,
    )
    shown = files if len(files) <= 6 else files[:3] + [None] + files[-2:]
    for f in shown:
        print("  ..." if f is None else f"  {f['name']}  {human(f['bytes'])}", file=out)
    if len(files) > 1:
        print("  model.safetensors.index.json", file=out)


def _seconds(s: float | None, option: str) -> str:
    if s is None:
        return f"({option})"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def print_resume_times(r: dict[str, Any], out=sys.stdout) -> None:
    """Incremental rows: a resume's checksum check (spread over the ranks; on one host for comparison)
    and `slimckpt convert --to verl` of one step (slimckpt.plan.resume_time)."""
    rows = [e for e in r["estimates"] if e.get("resume_times")]
    if not rows:
        return
    print(
        "resume and leave, per step of resume state (verify: true; the driver checks sizes only, each rank "
        "checksums its share before it loads):",
        file=out,
    )
    head = ["strategy", "resume state", "check at resume", "(on one host)", "slimckpt convert --to verl"]
    table = [
        [
            e["strategy"],
            human(t["resume_bytes"]),
            _seconds(t["check_spread_s"], "--disk-gbps"),
            _seconds(t["check_one_host_s"], "--writer-gbps"),
            _seconds(t["convert_s"], "--writer-gbps"),
        ]
        for e in rows
        for t in [e["resume_times"]]
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    for row in [head, ["-" * n for n in widths], *table]:
        print("  ".join(str(x).ljust(n) for x, n in zip(row, widths)).rstrip(), file=out)
    writer = r.get("writer") or {}
    print(
        f"  check: the step read once at the storage's {r['disk_gbps'] or '?'} GB/s (--disk-gbps), each rank hashing "
        f"its share; one host would read it all at {writer.get('gbps') or '?'} GB/s ({writer.get('source') or '--writer-gbps'}). "
        f"convert: one process reads the step and writes verl's rank files at that node's share",
        file=out,
    )


def durable_cell(u: dict[str, Any]) -> str:
    if not u["supported"]:
        return "incremental only"
    return f"{u['durable_seconds']:.1f} s" + (" (export_hf=false)" if u["export_refused"] else "")


def print_s3(r: dict[str, Any], out=sys.stdout) -> None:
    """--storage s3: per row, what a save uploads, when the step is durable, and the upload's host
    memory; and `slimckpt merge` of the HF model to s3://."""
    s3 = r.get("s3")
    if not s3:
        return
    source = s3["upload_gbps_source"]
    source += "" if source == "--upload-gbps" else "; --upload-gbps sets it"
    print(
        f"S3 (--storage s3): {s3['upload_gbps']:g} GB/s to the object store for the whole job "
        f"({source}), parts of {human(s3['part_bytes'])}, "
        f"{s3['concurrency']} held at once per rank (--s3-part-mb, --s3-concurrency)",
        file=out,
    )
    head = [
        "strategy",
        "uploads / rank",
        "all ranks upload",
        "of which HF export",
        "time to durable",
        "upload buffers / rank",
        "host / rank with upload",
    ]
    table = []
    for e in r["estimates"]:
        u = e["s3"]
        if not u["supported"]:
            table.append([e["strategy"], "-", "-", "-", durable_cell(u), "-", "-"])
            continue
        export = (
            f"{human(u['rank0_export_upload_bytes'])} / {human(u['export_upload_bytes'])}"
            if u["export_upload_bytes"]
            else ("not uploaded" if u["export_refused"] else "-")
        )
        table.append(
            [
                e["strategy"],
                human(u["rank0_upload_bytes"]),
                human(u["total_upload_bytes"]),
                export,
                durable_cell(u),
                human(u["upload_buffer_bytes"]),
                human(u["host_peak_with_upload_bytes"]),
            ]
        )
    m = s3["merge"]
    table.append(
        [
            f"slimckpt merge ({m['dtype']})",
            "-",
            human(m["total_upload_bytes"]),
            human(m["total_upload_bytes"]),
            f"{m['durable_seconds']:.1f} s",
            f"{human(m['upload_buffer_bytes'])} / process",
            "-",
        ]
    )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    for row in [head, ["-" * n for n in widths], *table]:
        print("  ".join(str(x).ljust(n) for x, n in zip(row, widths)).rstrip(), file=out)
    refused = [e for e in r["estimates"] if not e["s3"]["supported"]]
    if refused:
        print(f"  {', '.join(e['strategy'] for e in refused)}: {refused[0]['s3']['reason']}", file=out)
    for e in r["estimates"]:
        if e["s3"].get("export_refused"):
            print(f"  {e['strategy']}: {e['s3']['export_refused']}", file=out)
    commit = s3["merge"]["commit_seconds"]
    print(
        f"  time to durable: every rank's bytes at the job's bandwidth, then the commit: one conditional PUT of the "
        f"manifest (If-None-Match: *, {commit:g} s assumed); uploads / rank: rank 0's resume state and its rows of "
        f"the HF export",
        file=out,
    )
    print(
        f"  upload buffers: part size x parts held (+1 per further write thread) + 64 MiB, whatever the model "
        f"size, on top of the save's own host memory; slimckpt merge --target_dir s3://...: the HF model merged "
        f"into local scratch, then uploaded by one process at {m['gbps']:g} GB/s ({m['gbps_source']}; the merge "
        f"itself not timed)",
        file=out,
    )
    for e in r["estimates"]:
        for n in e["s3"].get("notes", []):
            print(f"  {e['strategy']}: {n}", file=out)
    for n in m["notes"]:
        print(f"  slimckpt merge: {n}", file=out)


def print_stream(r: dict[str, Any], out=sys.stdout) -> None:
    """async_save=stream rows: what the next optimizer step's guard does for each rollout window."""
    rows = [e for e in r["estimates"] if e.get("stream")]
    if not rows:
        if any("async_save=stream" in e["strategy"] for e in r["estimates"]) and not r["disk_gbps"]:
            print("stream mode: pass --disk-gbps for the blocked time against the rollout window", file=out)
        return
    print(
        "stream mode (slimckpt.plan.stream): training blocks only if the next optimizer step comes before the "
        "write ends;\n  its guard then copies what is unread into host memory (within host_memory_budget_gb) "
        "and waits for the writer for the rest",
        file=out,
    )
    kept = any(b.get("kept_bytes") for e in rows for b in e["stream"])
    head = [
        "strategy",
        "rollout window",
        "unread at the step",
        *(["kept (offload's host copies)"] if kept else []),
        "guard copies",
        "waits for the writer",
        "blocked",
    ]
    table = []
    for e in rows:
        for b in e["stream"]:
            blocked = (
                f"{b['blocked_s']:.1f} s"
                if b["blocked_s"] is not None
                else f"{b['wait_s']:.1f} s + copy of {human(b['copied_bytes'])}"
            )
            table.append(
                [
                    e["strategy"],
                    f"{b['window_s']:.1f} s",
                    human(b["pending_bytes"]),
                    *([human(b.get("kept_bytes", 0))] if kept else []),
                    human(b["copied_bytes"]),
                    f"{b['wait_s']:.1f} s",
                    blocked,
                ]
            )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    for row in [head, ["-" * n for n in widths], *table]:
        print("  ".join(str(x).ljust(n) for x, n in zip(row, widths)).rstrip(), file=out)


def print_node(r: dict[str, Any], out=sys.stdout) -> None:
    """Per rank and per node: verl's offload plus the save, against the node and the budget."""
    node, rows = r.get("node"), r.get("node_rows") or []
    if not node or not rows:
        return
    resident = ", ".join(f"{k} {human(v)}" for k, v in node["resident"].items()) or "nothing (no offload)"
    ranks = f"{node['local_ranks']} ranks" + ("" if node["local_ranks_given"] else " (assumed; --gpus-per-node)")
    print(
        f"per node: {ranks}, {human(node['memory_bytes'])} of host memory ({node['memory_source']}); "
        f"held per rank between steps by verl's offload: {resident}",
        file=out,
    )
    head = ["strategy", "host / rank", "host / node", "budget / rank", "device added / rank", "blocked / save", "fits"]
    table = []
    for v in rows:
        blocked = "-" if v["blocked_s"] is None else f"{v['blocked_s']:.1f} s"
        table.append(
            [
                v["strategy"],
                human(v["per_rank_bytes"]),
                human(v["per_node_bytes"]),
                human(v["budget_bytes"]) if v["budget_bytes"] is not None else "-",
                human(v["device_bytes"]) if v["device_bytes"] else "0",
                blocked,
                "yes" if v["fits"] else "NO",
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    for row in [head, ["-" * n for n in widths], *table]:
        print("  ".join(str(x).ljust(n) for x, n in zip(row, widths)).rstrip(), file=out)
    for v in rows:
        for problem in v["problems"]:
            print(f"  {v['strategy']}: {problem}", file=out)


def print_peak_disk(r: dict[str, Any], out=sys.stdout) -> None:
    roles = ("actor", "critic") if r.get("critic") else ("actor",)
    print(
        "peak disk while a step is written (per step x steps held; retention keeps the newest "
        "max_*_ckpt_to_keep, slimckpt deletes only after the new step is complete):",
        file=out,
    )
    head = ["strategy", "role", "keep", "per step", "verl's order", "slimckpt's order", "slimckpt, tracker behind"]
    rows = []
    for e in r["estimates"]:
        for role in roles:
            d = e["peak_disk"][role]
            keep = "all" if d["max_ckpt_to_keep"] is None else str(d["max_ckpt_to_keep"])
            if d["grows_without_bound"]:
                cells = ["grows without bound"] * 3
            else:
                cells = [
                    f"{human(d['verl_bytes'])} ({d['verl_steps']})",
                    f"{human(d['slimckpt_bytes'])} ({d['slimckpt_steps']})",
                    f"{human(d['slimckpt_bytes_tracker_behind'])} ({d['slimckpt_steps_tracker_behind']})",
                ]
            rows.append([e["strategy"], role, keep, human(d["per_step_bytes"]), *cells])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head, ["-" * n for n in widths], *rows]:
        print("  ".join(str(x).ljust(n) for x, n in zip(row, widths)).rstrip(), file=out)
    print(
        "  (n) = steps on disk. verl's rows (no recipe) run verl's order, +recipe rows slimckpt's: one "
        "step more (keep=1: 3 vs 2).\n  keep all = trainer.max_*_ckpt_to_keep null (verl's default): one more step per "
        "save, no bound.\n  tracker behind: the tracker names a step older than the newest keep at a commit (a "
        "failed save with on_save_error=continue, an async commit ahead of its watcher).",
        file=out,
    )
    if not r.get("critic"):
        print("  critic not counted: pass --critic for a run with one (PPO with GAE).", file=out)


def print_retention_disk(r: dict[str, Any], out=sys.stdout) -> None:
    """The rows of retention_disk: per strategy that saves optimizer state (or sets keep_best), the
    disk at each keep_optimizer_last choice."""
    roles = ("actor", "critic") if r.get("critic") else ("actor",)
    rows = []
    for e in r["estimates"]:
        for role in roles:
            for d in e.get("retention_disk", {}).get(role, []):
                if not d["optimizer_bytes"] and not d["keep_best"]:
                    continue
                last = "all kept" if d["keep_optimizer_last"] is None else f"newest {d['keep_optimizer_last']}"
                keep = "all" if d["max_ckpt_to_keep"] is None else str(d["max_ckpt_to_keep"])
                if d["steps"] is None:
                    held, usual, behind = "every step", f"+{human(d['bytes_per_save'])} per save", "-"
                else:
                    held = f"{d['steps']['whole']} whole + {d['steps']['without_optimizer']}"
                    usual, behind = human(d["bytes"]["usual"]), human(d["bytes"]["tracker_behind"])
                rows.append(
                    [
                        e["strategy"],
                        role,
                        keep,
                        str(d["keep_best"]),
                        last,
                        f"{human(d['per_step_bytes'])} / {human(d['per_step_bytes'] - d['optimizer_bytes'])}",
                        held,
                        usual,
                        behind,
                    ]
                )
    if not rows:
        return
    print(
        "retention with keep_optimizer_last / keep_best (slimckpt's order; --set keep_optimizer_last=N "
        "--set keep_best=K --set best_metric=M):",
        file=out,
    )
    head = [
        "strategy",
        "role",
        "keep",
        "best",
        "optimizer in",
        "step whole / without optimizer",
        "steps held (whole + without)",
        "peak disk",
        "tracker behind",
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head, ["-" * n for n in widths], *rows]:
        print("  ".join(str(x).ljust(n) for x, n in zip(row, widths)).rstrip(), file=out)
    print(
        "  a step without its optimizer keeps model, extra state and export; the optimizer of the step before the "
        "newest goes\n  before the next step is written (the tracker names it at the newest's commit). keep_best "
        "counts its steps as extra ones (none among the newest).",
        file=out,
    )
