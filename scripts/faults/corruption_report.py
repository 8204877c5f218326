"""RELIABILITY.md's corruption lines and its damaged-restart section, from the campaigns' results
(docs/reliability/corruption.json, damaged_restarts.json). Nothing here damages or loads a checkpoint;
scripts/faults/corruption.py does."""

from __future__ import annotations


def render(result: dict) -> str:
    s = result["slimckpt"]
    lines = [
        f"slimckpt formats: {s['detected']}/{s['trials']} detected, {s['named_right_file']} naming the damaged "
        f"file; load refused with verify's line: {s['load_refused_same_message']}/{s['load_trials']} "
        f"(check), "
        + (
            f"{s['real_load_refused_same_message']}/{s['load_trials']} (verl's manager under torchrun)"
            if s["real_load_run"]
            else "real load not run (--no_real_load)"
        )
    ]
    for fmt, kinds in s["by_format_kind"].items():
        for kind, k in kinds.items():
            lines.append(
                f"  {fmt:12s} {kind:15s} {k['detected']}/{k['trials']} detected, {k['named_right_file']} named"
            )
    n = result["native"]
    lines.append(f"verl-native (no manifest): {n['detected']}/{n['trials']} detected")
    for kind, k in n["by_kind"].items():
        lines.append(f"  native       {kind:15s} {k['detected']}/{k['trials']} detected, {k['named_right_file']} named")
    for t in result["missed"]:
        lines.append(f"  missed: {t['format']} {t['damage']}")
    lines.append(f"{result['seconds']} s (building the checkpoints: {result['build_seconds']} s)")
    return "\n".join(lines)


def render_damaged(r: dict) -> str:
    """RELIABILITY.md's section for a --damaged_restarts run."""
    kinds = ", ".join(f"{kind} {sum(v.values())}" for kind, v in r["by_kind"].items())
    outcomes = ", ".join(f"{n} {name}" for name, n in sorted(r["outcomes"].items()))
    line = r.get("example_line", "").replace(r.get("example_line", "").split("/trial_")[0], "$WORK")
    return "\n".join(
        [
            "## The newest step damaged, then `resume_mode=auto`",
            "",
            f"`python -m scripts.faults.corruption --damaged_restarts {r['restarts']} --seed {r['seed']} --json OUT` "
            f"on {r.get('commit', 'an unrecorded commit')}, {r['seconds']:.0f} s. `+recipe=incremental` (async, export on), "
            "verl's real `FSDPCheckpointManager` and `PPOTrainer._load_checkpoint` under torchrun (gloo, 2 ranks): "
            "steps 2 and 4 committed, step 4 then damaged on disk, and the run restarted.",
            "",
            f"**{outcomes} of {r['restarts']} restarts** ({kinds}). *Exact*: the run continued from step 2 with model, "
            "optimizer and scheduler state equal to a direct load of step 2 and the same next loss, in one line naming "
            "the damaged file; the tracker names step 2, step 4 stays on disk untouched, `resume_from_path` to step 4 "
            "refuses in one line, and a save of step 3 afterwards moves the tracker to 3 "
            f"(here: {r.get('tracker_after_saving_3')}). verl 0.9.1 loads the step its tracker names without a check "
            "of its own; this campaign runs only slimckpt's side.",
            "",
            f"The line a user sees: `{line}`",
            "",
        ]
    )
