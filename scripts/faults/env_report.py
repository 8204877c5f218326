"""The environment-fault table (one row per path and fault: the exit, the line a user sees, whether a partial step
looks committed) and its verdicts, from the campaign's rows (docs/reliability/env_faults.json). Nothing here
starts a child or a mount; scripts/faults/env.py does."""

from __future__ import annotations

# the paths a campaign drives: merges (a target dir) and trainer saves (a checkpoint root)
MERGE_PATHS = ["merge", "verl_merge"]
SAVE_PATHS = ["verl_save", "quickstart", "intermediate", "incremental_sync", "incremental_async", "quickstart_continue"]


def verdict(row: dict) -> str:
    if row.get("skipped"):
        return "skipped"
    if not row["failed"]:
        return "NO ERROR"
    bad = []
    if row["looks_committed"]:
        bad.append("partial looks committed")
    if row.get("tracker_moved"):
        bad.append("tracker moved")
    if not row.get("names_path"):
        bad.append("message names no path")
    message = row.get("message") or ""
    if row.get("path") in SAVE_PATHS and "--target_dir" in message:
        bad.append("a merge's fix for a trainer")  # the trainer's is trainer.default_local_dir / on_save_error
    if row.get("fault") == "export_full" and "huggingface" not in message:
        bad.append("did not fail in the export")
    return "ok" if not bad else "; ".join(bad)


def render(rows: list[dict]) -> str:
    out = [
        "| path | fault | mechanism | exit | one line | names path | looks committed | tracker moved | verdict "
        "| message |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        msg = (r.get("message") or "").replace("|", "\\|")
        tm = "" if r.get("tracker_moved") is None else ("yes" if r["tracker_moved"] else "no")
        lc = "" if r.get("looks_committed") is None else ("YES" if r["looks_committed"] else "no")
        out.append(
            f"| {r['path']} | {r['fault']} | {r.get('mechanism') or 'n/a'} | {r.get('exit', '')} | "
            f"{'yes' if r.get('one_line') else 'no'} | {'yes' if r.get('names_path') else 'no'} | {lc} | {tm} | "
            f"{verdict(r)} | {msg[:400]} |"
        )
    return "\n".join(out)
