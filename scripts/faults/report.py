"""RELIABILITY.md from docs/reliability/*.json (scripts/faults/reliability.py writes them; `--render` re-renders).

Every row is checked against HEAD (`staleness`): a row whose recorded commit differs from HEAD in the
code that row exercises is marked **[stale]** and a line under its table names the commit and the
paths changed since; one whose commit is not recorded, not in the repository, or cannot be checked
(no git) is marked **[commit unknown]**. Re-rendering (`python -m scripts.faults.reliability --render`)
re-checks without rerunning anything.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scripts.faults import oracle

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The code each row exercises (this module only renders, so it is not in any list; verl is pinned):
# the SIGKILL campaign's drivers, slimckpt's code, and what each side campaign runs.
FAULT_SCRIPTS = (
    "scripts/faults/reliability.py",
    "scripts/faults/reliability_merge.py",
    "scripts/faults/forks.py",
    "scripts/faults/trial.py",
    "scripts/faults/trial_model.py",
    "scripts/faults/oracle.py",
)
# `slimckpt plan` and `slimckpt dryrun` (patches/slimckpt/plan) are arithmetic no campaign runs: a
# change there leaves every row as measured
PLAN_CODE = "patches/slimckpt/plan"
OUR_CODE = ("patches", "recipes", f":(exclude){PLAN_CODE}")
RANK_SCRIPTS = (
    "scripts/faults/ranks.py",
    "scripts/faults/ranks_merge.py",
    "scripts/faults/ranks_settings.py",
    "scripts/faults/forks.py",
)
SIDE_CODE = {
    "corruption_campaign.py": OUR_CODE + ("scripts/faults/corruption.py", "scripts/faults/corruption_damage.py"),
    # the environment campaign takes its checkpoint builder and its resume scenario from slimckpt_testing (in patches)
    "env_faults.py": OUR_CODE + ("scripts/faults/env.py", "scripts/faults/env_places.py"),
    "rank_faults.py": OUR_CODE + RANK_SCRIPTS,
}
# the campaigns `make faults` runs besides the SIGKILL one, by the name side_runs.json records them under
SIDE_MODULES = {
    "corruption_campaign.py": "scripts.faults.corruption",
    "env_faults.py": "scripts.faults.env",
    "rank_faults.py": "scripts.faults.ranks",
}
STALE, UNKNOWN = "stale", "commit unknown"


def rank_code(mode: str) -> tuple[str, ...]:
    """What a rank-loss row exercises: verl's own row the campaign's script only, slimckpt's also its code."""
    return RANK_SCRIPTS if mode == "verl-default" else SIDE_CODE["rank_faults.py"]


def sigkill_code(mode: str) -> tuple[str, ...]:
    """What a SIGKILL row exercises: verl's own rows the fault scripts only, slimckpt's also its code."""
    return OUR_CODE + FAULT_SCRIPTS if mode in OURS else FAULT_SCRIPTS


def provenance(run: dict) -> dict:
    """{"commit", "dirty"} of a run's JSON: recorded since the staleness check exists; older JSONs name
    the commit in their "source" sentence only (reliability.source_note); else the commit is None."""
    if run.get("commit"):
        return {"commit": run["commit"], "dirty": run.get("dirty")}
    source = run.get("source") or ""
    m = re.search(r"clean export of commit ([0-9a-f]{7,40})", source)
    if m:
        return {"commit": m.group(1), "dirty": False}
    m = re.search(r"the working tree at ([0-9a-f]{7,40})( with uncommitted changes)?", source)
    if m:
        return {"commit": m.group(1), "dirty": bool(m.group(2))}
    return {"commit": None, "dirty": None}


def git(repo: str, *args: str) -> subprocess.CompletedProcess | None:
    """None when git cannot run here."""
    try:
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None


@dataclass(frozen=True)
class Flag:
    marker: str  # STALE or UNKNOWN
    note: str  # what the line under the table says about it


def staleness(
    prov: dict | None,
    paths: tuple[str, ...],
    repo: str = REPO,
    run_git: Callable[..., subprocess.CompletedProcess | None] = git,
) -> Flag | None:
    """None when the row's recorded commit has HEAD's version of `paths` (`git diff --quiet <commit>
    HEAD -- <paths>`), else why not."""
    commit = (prov or {}).get("commit")
    if not commit:
        return Flag(UNKNOWN, "no commit recorded for this run")
    if (prov or {}).get("dirty"):
        return Flag(UNKNOWN, f"run on {commit} with uncommitted changes")
    found = run_git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    if found is None:
        return Flag(UNKNOWN, f"run on {commit}; git is not available here to compare it with HEAD")
    if found.returncode != 0:
        return Flag(UNKNOWN, f"run on {commit}, which is not a commit of this repository")
    full = found.stdout.strip()
    diff = run_git(repo, "diff", "--name-only", full, "HEAD", "--", *paths)
    if diff is None or diff.returncode != 0:
        return Flag(UNKNOWN, f"run on {commit}; git could not compare it with HEAD")
    changed = diff.stdout.split()
    if not changed:
        return None
    head = run_git(repo, "rev-parse", "--short=12", "HEAD")
    count = run_git(repo, "rev-list", "--count", f"{full}..HEAD", "--", *paths)
    commits = f"{count.stdout.strip()} commit(s)" if count is not None and count.returncode == 0 else "commits"
    shown = ", ".join(f"`{c}`" for c in changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    at = f"{head.stdout.strip()} (HEAD when this was rendered)" if head is not None and head.returncode == 0 else "HEAD"
    return Flag(STALE, f"run on {commit}; {commits} up to {at} changed {shown}")


def mark(label: str, flag: Flag | None) -> str:
    return label if flag is None else f"{label} **[{flag.marker}]**"


def flag_notes(flags: dict[str, Flag | None]) -> list[str]:
    """One line per distinct flag under a table, naming its rows."""
    by_note: dict[Flag, list[str]] = {}
    for key, flag in flags.items():
        if flag is not None:
            by_note.setdefault(flag, []).append(key)
    return [f"**[{flag.marker}]** {', '.join(keys)}: {flag.note}." for flag, keys in by_note.items()]


class Checker:
    """Each row's flag, computed once per render."""

    def __init__(self, repo: str = REPO, run_git: Callable = git) -> None:
        self.repo, self.run_git, self.cache = repo, run_git, {}

    def __call__(self, prov: dict | None, paths: tuple[str, ...]) -> Flag | None:
        key = (json.dumps(prov, sort_keys=True), paths)
        if key not in self.cache:
            self.cache[key] = staleness(prov, paths, self.repo, self.run_git)
        return self.cache[key]


LABELS = {
    "verl-default": "verl 0.9.1 default (`CheckpointConfig`, model+optimizer+extra; slimckpt off)",
    "quickstart": "slimckpt `+recipe=quickstart` (model only)",
    "incremental-sync": "slimckpt `+recipe=incremental`",
    "incremental-async": "slimckpt `+recipe=incremental` `async_save=true`",
    "incremental-stream": "slimckpt `+recipe=incremental` `async_save=stream`",
    "merge": "`slimckpt merge` (streaming, manifest + rename commit)",
    "verl-merge": "verl 0.9.1 `FSDPModelMerger` (`python -m verl.model_merger merge`)",
}
OURS = ("quickstart", "incremental-sync", "incremental-async", "incremental-stream", "merge")


def _pairs(counts: dict[str, Any], sep: str = " ") -> str:
    return ", ".join(f"{k}{sep}{v}" for k, v in counts.items())


def _save_rows(modes: dict[str, Any], flags: dict[str, Flag | None] | None = None) -> list[str]:
    rows = [
        "| mode | max_ckpt_to_keep | trials | exact | clean start | lost committed | crash on load | "
        "wrong state | partial | tracker → uncommitted |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, e in modes.items():
        if e["kind"] != "save":
            continue
        label = mark(LABELS[e["mode"]], (flags or {}).get(key))
        if "error" in e:
            rows.append(f"| {label} | {e['max_ckpt_to_keep']} | — | could not run: {e['error']} |||||||")
            continue
        c = e["summary"]["outcomes"]
        rows.append(
            f"| {label} | {e['max_ckpt_to_keep']} | {len(e['trials'])} | {c.get('exact', 0)} | "
            f"{c.get('clean-start', 0)} | {c.get('lost-committed', 0)} | {c.get('crash-on-load', 0)} | "
            f"{c.get('loaded-wrong-state', 0)} | "
            f"{c.get('loaded-partial', 0)} | {e['summary']['tracker_names_uncommitted']} |"
        )
    return rows


CAUSES = (
    (
        "invalid literal for int()",
        "**empty tracker**: verl's `_save_checkpoint` writes "
        "`latest_checkpointed_iteration.txt` with `open(..., 'w')` then `write` (no temp file and rename); a kill "
        "between the two leaves an empty file and "
        "`find_latest_ckpt_path` raises. With a recipe on, that write goes to a temporary file renamed into place "
        "(`slimckpt.save.driver.tracker_write`)",
    ),
    (
        "FileNotFoundError",
        "**tracker names a deleted step**: verl's retention (`register_checkpoint`, with "
        "max_ckpt_to_keep=1) deletes the previous step's actor dir inside the save, before the trainer moves the "
        "tracker; a kill in between leaves the tracker on a step without its shards",
    ),
)


def check_words() -> str:
    return (
        f"slimckpt's rows are checked against HEAD in "
        f"{', '.join(f'`{p}`' for p in OUR_CODE + FAULT_SCRIPTS if not p.startswith(':'))} (but `{PLAN_CODE}`)"
        f"; verl's in the scripts only (verl itself is pinned)"
    )


def _flag_lines(flags: dict[str, Flag | None], checked: str) -> list[str]:
    notes = flag_notes(flags)
    return notes + [f"({checked}.)", ""] if notes else []


def _findings(modes: dict[str, Any]) -> list[str]:
    """What caused each bad outcome, counted over every row."""
    seen: dict[str, list[str]] = {}
    other = []
    for key, e in modes.items():
        for t in e.get("trials", []):
            if e["kind"] != "save" or t["outcome"] not in oracle.BAD:
                continue
            cause = next((c for needle, c in CAUSES if needle in t["why"]), None)
            if cause is None:
                other.append(f"{key} trial {t['trial']}: {t['outcome']}: {t['why'][:200]}")
            else:
                seen.setdefault(cause, []).append(key)
    if not seen and not other:
        return ["No bad outcome in any save row.", ""]
    out = ["What the bad outcomes were:", ""]
    for cause, keys in seen.items():
        counts = ", ".join(f"{k} {keys.count(k)}" for k in dict.fromkeys(keys))
        out.append(f"- {cause} ({counts}).")
    out += [f"- {line}" for line in other]
    return out + ["", FIXED_SINCE, ""]


# What the first full campaign (commit 07fe381) found in slimckpt's own rows, fixed before the rows above were rerun
FIXED_SINCE = (
    "Found by the first full run (commit 07fe381) and fixed before slimckpt's rows above were run again: an "
    "**empty tracker** (verl's `_save_checkpoint` writes `latest_checkpointed_iteration.txt` with `open(..., 'w')` "
    "then `write`; a kill between the two crashed the resume on `int('')`: quickstart@keep=2 1 of 50, and verl's "
    "default path in a calibration run) - `slimckpt.resume.tracker_recovery` now resumes from the newest complete step; and, "
    "with async saves at keep=1, a committed step deleted by the next commit before the tracker watcher saw it "
    "(training stopped after 120 s; seen once outside the trials) - the watcher now gives such a step up. "
    "Found later, when the uncut run of incremental-async@keep=1 hung twice in two: retention removes "
    "the step's role dir and leaves its data.pt, and the watcher gave up only a removed step dir, so it waited for "
    "a manifest that could no longer appear - since commit 6696ca6 it gives up a step whose role dir has no "
    "manifest once a newer step of that role is committed (tests/e2e/test_faults.py reproduces it). "
    "Found by the rank-loss campaign (commit 247fd10): the same cut tracker when rank 0's trainer was killed inside "
    "that write in the sync incremental tier (the resume repaired it and was exact, but plain verl would crash on it) "
    "- the trainers' tracker write is now atomic with a recipe on (`slimckpt.save.driver.tracker_write`). "
    "Found by the full run of commit 6d85f23 (incremental-async@keep=1: 2 crashes on load in 50): a **tracker "
    "naming a step whose actor dir retention had deleted**. The next step's actor commit read the tracker while it "
    "still named the step before, and deleted the step in between just as the watcher, which had found it whole, "
    "named it; a kill before the next step's tracker write left no step to resume at or below the tracker's. Since "
    "commit 9cd4abc the watcher checks and names a step under shared locks on its role dirs and retention reads the "
    "tracker again under its exclusive lock (tests/save/test_tracker.py and tests/save/test_prune.py hold the two "
    "orders of that interleaving); the run of commit 6d85f23 is kept in docs/reliability/history/."
)


def _merge_findings(modes: dict[str, Any]) -> list[str]:
    out = []
    for key, e in modes.items():
        broken = [
            t for t in e.get("trials", []) if e["kind"] == "merge" and t["outcome"] == "looks-complete-but-broken"
        ]
        if broken:
            how = (
                "writes into the target directly (no temporary dir, no manifest)"
                if e["mode"] == "verl-merge"
                else "left a target that does not verify"
            )
            out.append(
                f"- {key}: {len(broken)} kill(s) left config.json plus every weight file in the target, with "
                f"bytes that differ from an uncut run's: it {how}."
            )
    return out + [""] if out else []


def _merge_rows(modes: dict[str, Any], flags: dict[str, Flag | None] | None = None) -> list[str]:
    rows = [
        "| tool | trials | no complete-looking output | complete and correct | looks complete but broken | "
        "rerun failed | where the kills landed |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, e in modes.items():
        if e["kind"] != "merge":
            continue
        c = e["summary"]["outcomes"]
        rows.append(
            f"| {mark(LABELS[e['mode']], (flags or {}).get(key))} | {len(e['trials'])} | {c.get('absent', 0)} | "
            f"{c.get('complete-verified', 0)} | {c.get('looks-complete-but-broken', 0)} | "
            f"{c.get('rerun-failed', 0)} | {_pairs(e['summary']['states'])} |"
        )
    return rows


def _details(modes: dict[str, Any]) -> list[str]:
    out = []
    for key, e in modes.items():
        if "error" in e:
            continue
        s = e["summary"]
        q = s["kill_s"]
        if e["kind"] == "save":
            cal = e["calibration"]
            out += [
                f"**{key}** — kills uniform within {e['window_s']:.3f} s of the start of the save of a random "
                f"step 1-4 (1.3x the calibrated median from a save's start to its commit, "
                f"{cal['save_to_commit_s']:.3f} s; the save call itself {cal['save_call_s']:.3f} s, a train+save "
                f"period {cal['period_s']:.3f} s); kill time after that save began, quartiles "
                f"{', '.join(f'{x:.3f}' for x in q)} s; step at the kill: "
                f"{_pairs(dict(sorted(s['steps_at_kill'].items(), key=lambda kv: int(kv[0]))), ': ')}.",
                "",
                f"- where rank 0 was (its last event before the kill): "
                f"{_pairs(dict(sorted(s['phases'].items(), key=lambda kv: -kv[1])))}",
                f"- exact loads of a step whose commit point passed just before the kill (its `committed` "
                f"line not yet written): {s['loaded_in_flight_step']}",
            ]
            if s["errors"]:
                out += ["- crash-on-load errors: " + "; ".join(f"`{k}` ×{v}" for k, v in s["errors"].items())]
            bad = [t for t in e["trials"] if t["outcome"] in oracle.BAD][:3]
            for t in bad:
                out.append(
                    f"- e.g. trial {t['trial']}: killed in `{t['phase_rank0']}` of step {t['step_at_kill']}, "
                    f"last committed {t['last_committed']}, tracker {t['found']['tracker']}, "
                    f"dirs {json.dumps(t['found']['steps'])}: {t['outcome']} — {t['why']}"
                )
            out.append("")
        else:
            cal = e["calibration"]
            out += [
                f"**{key}** — uncut merge {cal['merge_s']:.2f} s (median of 3), its output dir appearing "
                f"{cal['merge_s'] - cal.get('output_to_exit_s', 0):.2f} s after the start; kills uniform within "
                f"{e['window_s']:.3f} s (1.15x the rest of the run) of the output dir's appearance; kill time "
                f"after it, quartiles {', '.join(f'{x:.3f}' for x in q)} s.",
                "",
            ]
    return out


def _side(
    title: str, side: dict | None, script: str, name: str, seconds: float | None, flag: Flag | None = None
) -> list[str]:
    """Another campaign's section, rendered by that script's own `render`."""
    if side is None:
        return [
            f"## {title}",
            "",
            f"Not run: no docs/reliability/{name} (`{SIDE_MODULES[script]}` missing or skipped).",
            "",
        ]
    took = f", {seconds / 60:.1f} min here" if seconds else ""
    out = [
        f"## {title}",
        "",
        f"`python -m {SIDE_MODULES[script]} --json docs/reliability/{name}` (run by `make faults`{took}; "
        f"rendered by that script).",
        "",
    ]
    if flag is not None:
        out += [
            f"**[{flag.marker}]** every figure of this section: {flag.note} "
            f"(checked: {', '.join(f'`{p}`' for p in SIDE_CODE.get(script, ()))}).",
            "",
        ]
    if "error" in side:
        return out + [f"Failed: {side['error']}", ""]
    try:
        module = importlib.import_module(SIDE_MODULES[script])
        if "rows" in side:
            return out + [module.render(side["rows"]), ""]
        return out + ["```", module.render(side), "```", ""]
    except Exception as exc:  # noqa: BLE001 - their format may change; show the raw summary then
        raw = side.get("summary", side) if isinstance(side, dict) else side
        return out + [
            f"(its renderer failed: {type(exc).__name__}: {exc})",
            "```",
            json.dumps(raw, indent=1)[:3000],
            "```",
            "",
        ]


def render_report(
    sigkill: dict | None,
    corruption: dict | None,
    env: dict | None,
    side_runs: dict | None = None,
    check: Callable | None = None,
) -> str:
    """`check(provenance, paths) -> Flag | None` (default: git in this repository, `Checker`)."""
    check = check or Checker()
    lines = [
        "# Reliability",
        "",
        "What a crash does to a checkpoint, measured. Every figure here is written by one command,",
        "`make faults` (`python -m scripts.faults.reliability`), from the JSON in `docs/reliability/`.",
        "",
    ]
    if sigkill is None:
        return "\n".join(lines + ["No SIGKILL results yet: run `make faults`.", ""])
    modes = sigkill["modes"]
    provs = sigkill.get("provenance") or {}
    flags = {key: check(provs.get(key, provenance(sigkill)), sigkill_code(e["mode"])) for key, e in modes.items()}
    flagged = [key for key, f in flags.items() if f is not None]
    side_s = sum(v.get("seconds") or 0 for v in (side_runs or {}).values())
    if side_s:
        total = (sigkill.get("seconds", 0) + side_s) / 60
        load = sigkill.get("load_average_1min")
        load_text = (
            f"1-minute load average {load['start']} when the SIGKILL campaign started, {load['end']} when it ended"
            if load
            else "load average not recorded"
        )
        lines += [
            f"The whole `make faults` took {total:.1f} min here (SIGKILL campaign "
            f"{sigkill.get('seconds', 0) / 60:.1f} min, the {len(side_runs)} campaigns beside it "
            f"{side_s / 60:.1f} min), on "
            f"{sigkill.get('machine', {}).get('cpus', '?')} cores ({load_text}).",
            "",
        ]
    ours_bad = sum(e["summary"]["bad"] or 0 for e in modes.values() if e["mode"] in OURS)
    ours_n = sum(len(e["trials"]) for e in modes.values() if e["mode"] in OURS)
    verl_bad = sum(e["summary"]["bad"] or 0 for e in modes.values() if e["mode"] not in OURS)
    verl_n = sum(len(e["trials"]) for e in modes.values() if e["mode"] not in OURS)
    m = sigkill.get("machine", {})
    lines += [
        "## SIGKILL at a random moment",
        "",
        f"{sigkill['trials_per_mode']} trials per mode unless a row says otherwise, world size "
        f"{sigkill['world_size']}, seed {sigkill['seed']}; "
        f"{m.get('cpus', '?')} CPUs, torch {m.get('torch', '?')}, verl {m.get('verl', '?')}; "
        f"the rows below took {sigkill.get('seconds', 0) / 60:.1f} min"
        + (f"; slimckpt source: {sigkill['source']}" if sigkill.get("source") else "")
        + ". Commands:",
        "",
        *[
            f"- `{c}`"
            for c in [sigkill.get("command", "python -m scripts.faults.reliability")]
            + list(sigkill.get("extra_commands", []))
        ],
        "",
        f"**slimckpt: {ours_bad} bad outcomes in {ours_n} kills. verl 0.9.1's own paths: {verl_bad} bad in "
        f"{verl_n}.**"
        + (
            f" {len(flagged)} of the {len(flags)} rows below ran on code that is not HEAD's or cannot "
            f"be checked (marked under each table)."
            if flagged
            else ""
        ),
        "",
        "### Saving, then `resume_mode=auto`",
        "",
        *_save_rows(modes, flags),
        "",
        *_flag_lines({k: f for k, f in flags.items() if modes[k]["kind"] == "save"}, check_words()),
        "Good outcomes: *exact* (the step loaded is the last committed one, or a later one whose commit point",
        "had just passed, and every rank's model, optimizer, scheduler and RNG hash equal what was recorded",
        "for that step before its save) and *clean start* (nothing was committed yet). Bad: *lost committed*",
        "(a committed step was not resumed), *crash on load* (the resume raised or hung), *wrong state* /",
        "*partial* (loaded, but not the recorded state of a committed / an unfinished step). *tracker →",
        "uncommitted*: after the kill the tracker named a step without its manifest or data.pt (incremental).",
        "",
        *_findings(modes),
        "### Merging",
        "",
        *_merge_rows(modes, flags),
        "",
        *_flag_lines({k: f for k, f in flags.items() if modes[k]["kind"] != "save"}, check_words()),
        *_merge_findings(modes),
        "A killed merge must leave no output that looks complete (config.json plus every weight file, and for",
        "slimckpt its manifest) unless it is complete and byte-identical to an uncut run's; the same command",
        "rerun afterwards must succeed.",
        "",
        "### Where the kills landed",
        "",
        *_details(modes),
        "## Method",
        "",
        "- **Real code.** The trainer side is verl's own `PPOTrainer._save_checkpoint` and `_load_checkpoint`",
        "  (the v1 trainer, verl 0.9.1's default) called on a stand-in `self` that holds the config keys they",
        "  read; slimckpt's tracker patch wraps it as in a run. `actor_rollout_wg` and `critic_wg` (PPO:",
        "  `use_critic`) run each call on both ranks and return when both are done, like Ray's worker-group",
        "  call; each rank runs verl's `FSDPCheckpointManager` on a tiny FSDP2 Llama (the actor) and on verl's",
        "  critic class (a value head) over gloo, with slimckpt's patches applied only when each role's",
        "  `checkpoint:` block (verl's generated config, or `recipes/*.yaml` as shipped: the actor's HF export",
        "  on where the recipe has it) builds a `SlimCheckpointConfig` — verl's default mode checks that nothing",
        "  is patched. A step counts as committed when both roles are.",
        "- **Kills.** Both ranks train one step and save, back to back. The parent picks a step k in 1..4 and",
        "  a delay uniform in [0, 1.3 x the time from a save's start to its commit] (calibrated per mode by an",
        "  uncut run of 4 saves, which must itself resume exactly), watches rank 0's event log (1 ms polling)",
        "  for the start of save k, waits the delay and SIGKILLs both ranks within microseconds (a node",
        "  failure, an OOM kill of the job, a preemption). So most kills land inside a save (including",
        "  retention and, async, the background write), the rest early in the next step. Each rank logs",
        "  events with `os.write` (nothing written is lost to SIGKILL), which gives the phase of each kill.",
        "- **Oracle.** Training is deterministic; before each save every rank fsyncs a SHA-1 of its model",
        "  shards, optimizer state and param groups, scheduler state and torch RNG. A step is *committed*",
        "  when `_save_checkpoint` returned (sync: verl wrote the tracker after every rank's save returned) or,",
        "  async, when slimckpt's watcher moved the tracker. A fresh pair of processes (another seed) resumes",
        "  through `_load_checkpoint`; the step it lands on and its per-rank hashes decide the outcome. Only the",
        "  contents a mode loads are compared (quickstart: the model).",
        "- **Merge.** A verl FSDP checkpoint (world size 2, verl's own save) is merged by `slimckpt merge`, exec'd",
        "  as a fresh command in a forked process (a fresh interpreter, as a user's), or by verl's",
        "  `FSDPModelMerger` in a forked process, SIGKILLed at a uniform moment from when its output dir",
        "  appears (slimckpt: `<target>.partial`; verl: the target) to 1.15x the rest of an uncut run.",
        "- **Cost.** The parent imports torch, transformers and verl once and forks every rank, so a trial",
        "  costs about a second or two of CPU on a 2-core machine.",
        "",
        "## What this does not test",
        "",
        "- **Power loss.** SIGKILL leaves the page cache intact: every write the process made survives. A power",
        "  cut or kernel crash also drops unsynced pages, so what matters then is fsync (slimckpt fsyncs files,",
        "  the manifest and the tracker before the rename; verl fsyncs nothing). Not simulated here.",
        '- **One rank dying alone** or stalling: not here, in the section "One rank lost mid-save or mid-merge"',
        "  below (scripts/faults/ranks.py). Network filesystems (rename and fsync semantics differ on",
        "  NFS/Lustre); GPU runs (device-to-host copies, pinned staging) — the save paths are the same code,",
        "  but timing differs.",
        "- A tiny model: a save takes a fraction of a second, so a kill lands in each phase in proportion to its",
        "  duration here, not on a 70B run.",
        "- **`python -m verl.model_merger merge` redirected to slimckpt** (verl's own entry point): the same",
        "  writer as `slimckpt merge`, started after verl's imports; killed only in the merge cell's run at",
        "  8dd49f4 (50 kills, 0 broken).",
        "",
    ]
    took = {k: v.get("seconds") for k, v in (side_runs or {}).items()}
    runs = side_runs or {}
    lines += _side(
        "Corruption of committed checkpoints",
        corruption,
        "corruption_campaign.py",
        "corruption.json",
        took.get("corruption_campaign.py"),
        check(provenance(runs.get("corruption_campaign.py") or {}), SIDE_CODE["corruption_campaign.py"]),
    )
    lines += _side(
        "Environment faults",
        env,
        "env_faults.py",
        "env_faults.json",
        took.get("env_faults.py"),
        check(provenance(runs.get("env_faults.py") or {}), SIDE_CODE["env_faults.py"]),
    )
    return "\n".join(lines)
