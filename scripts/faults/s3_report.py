"""RELIABILITY.md's S3 section: the table of outcomes per fault cell and the words around it, from the campaign's
trials (docs/reliability/s3.json). Nothing here runs a trial or a server; scripts/faults/s3.py does."""

from __future__ import annotations

CELLS = ("kill-mid-part", "kill-between", "kill-manifest", "kill-rank", "restart", "throttle", "revoke")
GOOD = ("exact", "resumed")
BAD = ("half-committed", "lost committed", "wrong state", "re-save failed", "hung", "bad message", "fault missed")


def summary(trials: list[dict]) -> list[dict]:
    rows = []
    for cell in CELLS:
        mine = [t for t in trials if t["cell"] == cell]
        if not mine:
            continue
        row = {"cell": cell, "trials": len(mine)}
        for outcome in GOOD + BAD:
            row[outcome] = sum(t["outcome"] == outcome for t in mine)
        row["failed in one line"] = sum(any(t.get("errors") or []) and t["outcome"] in GOOD for t in mine)
        rows.append(row)
    return rows


WHAT = {
    "kill-mid-part": "SIGKILL of both ranks mid-part (a part of a multipart upload half sent)",
    "kill-between": "SIGKILL of both ranks between parts (part k acknowledged, the next not begun)",
    "kill-manifest": "SIGKILL of both ranks at the manifest PUT (just before it / just after it landed)",
    "kill-rank": "SIGKILL of one rank after part k of its upload",
    "restart": "server stopped mid-save, started again 1-6 s later",
    "throttle": "throttling and 5xx answers, connections reset (10 kinds, through a fault proxy)",
    "revoke": "credentials revoked mid-save (server restarted with `-s3.config` without the key)",
}


SECTION_INTRO = (
    "Saves to `s3://` (docs/storage.md) cut by SIGKILLs at deterministic moments, a server stopped and\n"
    "restarted mid-save, throttling and 5xx answers through a fault proxy (`slimckpt_testing.s3_proxy`), and\n"
    "credentials revoked mid-save; each trial ends with a resume from the newest step whose manifest is under\n"
    "the prefix (found through the storage, no tracker) and, after a resume from step 1, a second save of the\n"
    "step that was cut. Below verl's driver: the ranks run the engine (`save_resume_state` inside the save\n"
    "patch's `guarded_save`) and load each step straight from the bucket, as a resume does (sizes and\n"
    "checksums checked by the ranks first). The whole-job kill through verl's trainer on `s3://` is\n"
    "`tests/e2e/test_s3_trainer_e2e.py` (one kill after step 3's commit, resumed exactly)."
)


def render_section(data: dict) -> str:
    """RELIABILITY.md's S3 section: its heading, what the campaign does, and `render`'s table."""
    return f"## S3\n\n{SECTION_INTRO}\n\n{render(data)}"


def render(data: dict) -> str:
    rows = summary(data["trials"])
    bad = sum(r[b] for r in rows for b in BAD)
    total = sum(r["trials"] for r in rows)
    lines = [
        f"World size 2, sync incremental saves through the engine to a local SeaweedFS, 5 MiB parts, one in flight "
        f"per rank; {data['host']}; slimckpt at commit {data['commit']}; the campaign took "
        f"{data['minutes']:.1f} min. Command:",
        "",
        f"- `{data['command']}` (its default counts; not part of `make faults`; `--render` prints this "
        f"section from `docs/reliability/s3.json`)",
        "",
        f"**{bad} bad outcomes in {total} trials.**",
        "",
        "| fault | trials | exact | resumed | failed in one line | " + " | ".join(BAD) + " |",
        "|---|---|---|---|---|" + "---|" * len(BAD),
    ]
    for r in rows:
        cells = [WHAT[r["cell"]], r["trials"], r["exact"], r["resumed"], r["failed in one line"]]
        cells += [r[b] for b in BAD]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += [
        "",
        "*exact*: step 2 committed and loads to the state recorded before its save, bit for bit. *resumed*: step 2 "
        "not committed, step 1 (found from the committed manifests under the prefix) loads exactly, and the next "
        "save of step 2 (after the same training step) commits and loads exactly. *failed in one line*: of the good "
        "trials, those whose faulted save failed in one line on every rank still running, naming `s3://bucket/key` "
        "and the fix (for one rank lost: the survivor's line names the step and the lost rank). "
        "Bad: *half-committed* (a manifest with a missing or changed object), *lost committed*, *wrong state*, "
        "*re-save failed*, *hung*, *bad message*; *fault missed* (the hook did not fire: the trial tested nothing). The moments are hooks in the ranks (`scripts/faults/s3.py`), "
        "not random timing.",
    ]
    bad_trials = [t for t in data["trials"] if t["outcome"] in BAD]
    for t in bad_trials[:10]:
        lines.append(f"- {t['cell']} #{t['index']} ({t['fault']}): {t['outcome']}: {t.get('why', '')}")
    return "\n".join(lines) + "\n"
