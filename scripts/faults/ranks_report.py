"""RELIABILITY.md's section of the lost-rank campaign (scripts/faults/ranks.py): its outcomes, tallied and
rendered from the campaign's JSON, torch-free, so that `make faults`' report needs none of the campaign's machinery."""

from __future__ import annotations

from collections.abc import Callable

from scripts.faults import oracle, report

GOOD = ("exact", "clean")
BAD = ("hung", "orphan", "committed-partial", "wrong-resume")
AT_COMMIT = "commit-outcome"  # a trial whose fault was placed at a commit's outcome (ranks.py --at-commit)


def _in_save(t: dict) -> bool:
    """A trial's in_save (merge trials: always; older results: from rank 0's phase)."""
    if "in_save" in t:
        return t["in_save"]
    if "hit" in t:  # a merge: the fault found the merge still running
        return t["hit"]
    return t.get("phase_rank0", "save") not in ("train", "hash", "committed", "ready", "setup")


def summarize(trials: list[dict]) -> dict:
    outcomes = [t["outcome"] for t in trials]
    ends = [t["survivors_end_s"] for t in trials if t["survivors_end_s"] is not None]
    return {
        "outcomes": oracle.tally(outcomes),
        "bad": sum(o in BAD for o in outcomes),
        "kills": sum(t["fault"] == "kill" for t in trials),
        "stalls": sum(t["fault"] == "stall" for t in trials),
        "named": sum(t["named"] for t in trials),
        "in_save": sum(_in_save(t) for t in trials),
        "named_in_save": sum(t["named"] for t in trials if _in_save(t)),
        "end_s": oracle.quantiles(ends),
        "at_commit": sum(t.get("at") == AT_COMMIT for t in trials),
        "at_commit_bad": sum(t.get("at") == AT_COMMIT and t["outcome"] in BAD for t in trials),
        # the step whose manifest was written before the fault is the one the relaunch resumed
        "at_commit_resumed_it": sum(t.get("at") == AT_COMMIT and t.get("loaded") == t["step"] for t in trials),
    }


LABELS = {
    "verl-default": "verl 0.9.1 default (slimckpt off)",
    "incremental-sync": "`+recipe=incremental` (export on)",
    "incremental-async": "`+recipe=incremental` `async_save=true` (export on)",
    "incremental-stream": "`+recipe=incremental` `async_save=stream` (export on)",
    "incremental-sync-noexport": "`+recipe=incremental` `export_hf=false`",
    "incremental-async-noexport": "`+recipe=incremental` `async_save=true` `export_hf=false`",
    "incremental-stream-noexport": "`+recipe=incremental` `async_save=stream` `export_hf=false`",
    "merge": "`torchrun ... slimckpt merge --distributed_merge`",
}


def render(data: dict, check: Callable | None = None) -> str:
    """The RELIABILITY.md section; each row checked against HEAD like the other sections' rows
    (`check(provenance, paths)`, default: git in this repository)."""
    check = check or report.Checker()
    labels = {m: LABELS.get(m, m) for m in data["modes"]}
    flags = {labels[m]: check(report.provenance(data), report.rank_code(m)) for m in data["modes"]}
    lines = [
        "## One rank lost mid-save or mid-merge",
        "",
        f"`{data.get('command', 'python -m scripts.faults.ranks')}` on {data.get('source', '?')}; "
        f"world sizes {', '.join(map(str, data['world_sizes']))}, process group timeout {data['timeout_s']:.0f} s "
        f"(a survivor still running {data['timeout_s'] + data['slack_s']:.0f} s after the fault counts as hung), "
        f"seed {data['seed']}, {data.get('seconds', 0) / 60:.1f} min.",
        "",
        "| mode | kills | stalls | exact | clean | hung | orphan | committed partial | wrong resume | "
        "lost rank named: faults in a save / all | survivors ended after (s, min/median/max) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    sums = {mode: summarize(e["trials"]) for mode, e in data["modes"].items()}  # older JSONs lack newer keys
    for mode, e in data["modes"].items():
        s = sums[mode]
        c = s["outcomes"]
        q = s["end_s"]
        ended = f"{q[0]:.1f} / {q[2]:.1f} / {q[4]:.1f}" if q else "—"
        n = len(e["trials"])
        lines.append(
            f"| {report.mark(labels[mode], flags[labels[mode]])} | {s['kills']} | {s['stalls']} | {c.get('exact', 0)} | "
            f"{c.get('clean', 0)} | {c.get('hung', 0)} | {c.get('orphan', 0)} | "
            f"{c.get('committed-partial', 0)} | {c.get('wrong-resume', 0)} | "
            f"{s['named_in_save']} of {s['in_save']} / {s['named']} of {n} | {ended} |"
        )
    notes = report.flag_notes(flags)
    if notes:
        lines += ["", *notes]
    ours = [e for m, e in data["modes"].items() if m != "verl-default"]
    ours_bad = sum(e["summary"]["bad"] for e in ours)
    lines += [
        "",
        f"**slimckpt: {ours_bad} bad outcome{'' if ours_bad == 1 else 's'} in "
        f"{sum(len(e['trials']) for e in ours)} single-rank faults.**"
        + (
            f" verl 0.9.1's own save path: {data['modes']['verl-default']['summary']['bad']} bad in "
            f"{len(data['modes']['verl-default']['trials'])}."
            if "verl-default" in data["modes"]
            else ""
        ),
        "",
    ]
    placed = [s for mode, s in sums.items() if mode != "verl-default"]
    n_placed = sum(p["at_commit"] for p in placed)
    if n_placed:
        lines += [
            f"Of slimckpt's faults, {n_placed} were placed at a commit's outcome ({data.get('at_commit_per_world', 1)} "
            "kill and as many stalls per save mode and world size): the victim stopped itself once rank 0 had written "
            "the manifest that completes a step, before any rank knew the commit's outcome. "
            f"{sum(p['at_commit_bad'] for p in placed)} bad; in {sum(p['at_commit_resumed_it'] for p in placed)} "
            "the relaunch resumed that very step (its data was all on disk; a failure after the manifest is raised "
            "but leaves the step committed), in the others the step before it (the tracker had not moved).",
            "",
        ]
    errors = [f"- {m}: {err}" for m, e in data["modes"].items() for err in e.get("errors", [])]
    bad = [
        f"- {m} ws{t['world']} {t['fault']} {t['trial']}: {t['outcome']} (victim rank {t['victim']} at "
        f"`{t.get('phase_victim')}`, tracker after the fault: {t.get('tracker')}; the resume: "
        f"{t.get('why') or t.get('resume')}; orphans {t['orphans']}, locks {t['locks_held']})"
        for m, e in data["modes"].items()
        for t in e["trials"]
        if t["outcome"] in BAD
    ]
    if errors or bad:
        lines += ["What went wrong:", "", *errors, *bad[:12], ""]
    lines += [
        "How: a fault lands at a uniform moment within 1.3x the calibrated time from a save's start to its",
        "commit (saves of steps 1-3), or, for the merge, within 1.15x the time from `<target>.partial`'s",
        "appearance to its rename into the target in an uncut run; the lost rank is drawn uniformly, rank 0",
        "included. A stall is SIGSTOP until every survivor ended (or the hang deadline), then SIGCONT or",
        "SIGKILL, alternately.",
        "*Lost rank named*: a survivor's output has a line naming that rank (slimckpt's `rank R of W stopped",
        "answering`, or torchrun's failure summary for the merge, whose agent ends the other workers when one",
        "dies); *in a save*: a surviving rank was inside a save at the fault (per its own log: its save call",
        "begun and, for slimckpt, that save's commit not yet known to it; for verl, the call not returned); the",
        "rest landed outside every survivor's save (the next step's training, the worker group's calls, rank",
        "0's tracker write), whose collectives fail with the backend's own error.",
        "The process group is gloo over a FileStore (the save) or torchrun's store (the merge); every process",
        "a trial starts is re-parented to the campaign if orphaned (PR_SET_CHILD_SUBREAPER), so none can",
        "survive unseen; lock files are probed with a non-blocking flock once every rank is gone. verl's own",
        "row has the same harness with slimckpt off; verl 0.9.1 has no distributed merge to compare.",
        "",
    ]
    return "\n".join(lines)
