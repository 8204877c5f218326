"""RELIABILITY.md from docs/reliability/*.json: the SIGKILL runs read back and merged (sigkill.json and any
sigkill_*.json), each campaign's trials summarised, and the report's sections put together in their order
(report.render_report, then the lost-rank and damaged-restart sections). Nothing here runs a trial;
scripts/faults/reliability.py does, and its `--render` writes reliability_md()."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

from scripts.faults import oracle, s3_report
from scripts.faults.corruption_report import render_damaged
from scripts.faults.ranks_report import render as render_rank_faults
from scripts.faults.report import REPO, Checker, provenance, render_report

OUT_DIR = os.path.join(REPO, "docs", "reliability")


def summarize(entry: dict) -> dict:
    trials = entry["trials"]
    if entry["kind"] == "merge":
        outcomes = [t["outcome"] for t in trials]
        return {
            "outcomes": oracle.tally(outcomes),
            "states": oracle.tally([t["state"] for t in trials]),
            "bad": sum(o in oracle.MERGE_BAD for o in outcomes),
            "kill_s": oracle.quantiles([t["kill_after_output_s"] for t in trials]),
        }
    outcomes = [t["outcome"] for t in trials]
    return {
        "outcomes": oracle.tally(outcomes),
        "bad": sum(o in oracle.BAD for o in outcomes),
        "phases": oracle.tally([t["phase_rank0"] for t in trials]),
        "loaded_in_flight_step": sum(
            1 for t in trials if t["outcome"] == "exact" and t["loaded"] not in (t["last_committed"], None)
        ),
        "tracker_names_uncommitted": sum(1 for t in trials if t["tracker_names_uncommitted"]),
        "kill_s": oracle.quantiles([t["kill_after_save_begin_s"] for t in trials]),
        "steps_at_kill": oracle.tally([str(t["step_at_kill"]) for t in trials]),
        "errors": oracle.tally([t["why"] for t in trials if t["outcome"] == "crash-on-load"]),
    }


def load_sigkill() -> dict | None:
    """sigkill.json, plus the modes of any sigkill_*.json (extra runs, e.g. `--keep 1 --json
    docs/reliability/sigkill_keep1.json`, read in name order; a mode run again replaces the earlier
    row), each row keeping its own trial count."""
    main = load_json("sigkill.json")
    if main is None:
        return None
    main.setdefault("extra_commands", [])
    sources = {key: main.get("source", "") for key in main["modes"]}
    # each row's commit, for report.staleness (older JSONs name it in "source" only)
    main["provenance"] = {key: provenance(main) for key in main["modes"]}
    for name in sorted(os.listdir(OUT_DIR)):
        if name.startswith("sigkill_") and name.endswith(".json"):
            extra = load_json(name)
            for key, entry in extra["modes"].items():  # a later run of a mode replaces the earlier one
                main["modes"][key] = entry
                sources[key] = extra.get("source", "")
                main["provenance"][key] = provenance(extra)
            main["extra_commands"].append(extra.get("command", ""))
    # the rows shown may come from runs of different commits: say which
    by_source: dict[str, list[str]] = {}
    for key in main["modes"]:
        by_source.setdefault(sources.get(key, ""), []).append(key)
    if len(by_source) > 1:
        main["source"] = "; ".join(
            f"{src or 'the working tree'} for {', '.join(keys)}" for src, keys in by_source.items()
        )
    # time of the rows shown (each mode's calibration and trials), as one `make faults` would spend it
    main["seconds"] = sum(entry.get("seconds", 0) for entry in main["modes"].values())
    return main


def load_json(name: str) -> dict | None:
    path = os.path.join(OUT_DIR, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def reliability_md(check: Callable | None = None) -> str:
    """RELIABILITY.md's text from the results under OUT_DIR; `check` flags the rows run on older code
    (report.render_report's, default: git in this repository)."""
    check = check or Checker()
    text = render_report(
        load_sigkill(), load_json("corruption.json"), load_json("env_faults.json"), load_json("side_runs.json"), check
    )
    lost = load_json("rank_faults.json")
    if lost is not None and "modes" in lost:  # one rank lost mid-save or mid-merge
        text = text.rstrip("\n") + "\n\n" + render_rank_faults(lost, check)
    damaged = load_json("damaged_restarts.json")
    if damaged is not None and "outcomes" in damaged:  # the newest step damaged, then a restart
        text = text.rstrip("\n") + "\n\n" + render_damaged(damaged)
    s3 = load_json("s3.json")
    if s3 is not None and "trials" in s3:  # `python -m scripts.faults.s3`, run on its own (not by make faults)
        text = text.rstrip("\n") + "\n\n" + s3_report.render_section(s3)
    return text
