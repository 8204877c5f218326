"""RELIABILITY.md's renderer (scripts/faults/report.py) flags rows that ran on code older than HEAD's:
checked with git in a scratch repository, no campaign run."""

import json
import subprocess

import pytest

from scripts.faults import reliability, reliability_report, report

from ..conftest import REPO

SLIM = report.sigkill_code("quickstart")
VERL = report.sigkill_code("verl-default")


def _git(repo, *args):
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def _commit(repo, files, message):
    for name, text in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "--short=12", "HEAD")


@pytest.fixture
def scratch(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    first = _commit(
        root,
        {
            "patches/slimckpt/a.py": "x = 1\n",
            "recipes/quickstart.yaml": "a: 1\n",
            "scripts/faults/reliability.py": "# driver\n",
            "scripts/faults/trial.py": "# trial\n",
            "scripts/faults/corruption.py": "# corruption\n",
            "docs/notes.md": "notes\n",
        },
        "first",
    )
    return root, first


def test_a_row_at_head_is_not_flagged(scratch):
    root, first = scratch
    assert report.staleness({"commit": first, "dirty": False}, SLIM, str(root)) is None
    assert report.staleness({"commit": first, "dirty": False}, VERL, str(root)) is None


def test_changes_to_docs_only_flag_nothing(scratch):
    root, first = scratch
    _commit(root, {"docs/notes.md": "more notes\n", "README.md": "readme\n"}, "docs")
    assert report.staleness({"commit": first}, SLIM, str(root)) is None


def test_a_row_older_than_a_change_to_patches_is_stale_and_says_what_changed(scratch):
    root, first = scratch
    head = _commit(root, {"patches/slimckpt/a.py": "x = 2\n", "docs/notes.md": "changed too\n"}, "code")
    flag = report.staleness({"commit": first, "dirty": False}, SLIM, str(root))
    assert flag.marker == report.STALE
    assert flag.note == (
        f"run on {first}; 1 commit(s) up to {head} (HEAD when this was rendered) changed `patches/slimckpt/a.py`"
    )
    # verl's rows exercise the fault scripts only: slimckpt's code moving leaves them as they are
    assert report.staleness({"commit": first}, VERL, str(root)) is None
    _commit(root, {"scripts/faults/trial.py": "# trial, changed\n"}, "driver")
    assert "`scripts/faults/trial.py`" in report.staleness({"commit": first}, VERL, str(root)).note


def test_a_change_to_the_plan_command_alone_leaves_slimckpts_rows_as_measured(scratch):
    root, first = scratch
    _commit(root, {"patches/slimckpt/plan/cost.py": "seconds = 1\n"}, "plan")
    assert report.staleness({"commit": first, "dirty": False}, SLIM, str(root)) is None
    _commit(root, {"patches/slimckpt/plan/cost.py": "seconds = 2\n", "patches/slimckpt/a.py": "x = 3\n"}, "both")
    assert report.staleness({"commit": first, "dirty": False}, SLIM, str(root)).note.endswith(
        "changed `patches/slimckpt/a.py`"
    )
    assert "(but `patches/slimckpt/plan`)" in report.check_words()


def test_what_cannot_be_checked_is_flagged_commit_unknown(scratch):
    root, first = scratch
    unknown = [
        report.staleness(prov, SLIM, str(root))
        for prov in ({"commit": None}, None, {"commit": "0123456789ab"}, {"commit": first, "dirty": True})
    ]
    assert all(f.marker == report.UNKNOWN for f in unknown)
    assert "not a commit of this repository" in unknown[2].note and "uncommitted changes" in unknown[3].note
    no_git = report.staleness({"commit": first}, SLIM, str(root), run_git=lambda *a: None)
    assert no_git.marker == report.UNKNOWN and "git is not available" in no_git.note


def test_provenance_reads_the_record_or_an_older_jsons_source_sentence():
    assert report.provenance({"commit": "abc1234", "dirty": False}) == {"commit": "abc1234", "dirty": False}
    assert report.provenance({"source": "a clean export of commit 6a59751396e0 (patches/ and recipes/)"}) == {
        "commit": "6a59751396e0",
        "dirty": False,
    }
    assert report.provenance({"source": "the working tree at 1234abc with uncommitted changes"}) == {
        "commit": "1234abc",
        "dirty": True,
    }
    assert report.provenance({"source": "/elsewhere (SLIMCKPT source outside the repo; repo HEAD 1234abc)"}) == {
        "commit": None,
        "dirty": None,
    }
    assert report.provenance({}) == {"commit": None, "dirty": None}


def _sigkill(modes):
    """The committed campaign's JSON, cut to the given rows."""
    sigkill = json.loads((REPO / "docs" / "reliability" / "sigkill.json").read_text())
    sigkill["modes"] = {k: v for k, v in sigkill["modes"].items() if k in modes}
    return sigkill


def test_the_report_marks_stale_rows_and_names_the_commit_under_their_table(scratch):
    root, first = scratch
    sigkill = _sigkill(("verl-default@keep=2", "quickstart@keep=2", "merge", "verl-merge"))
    sigkill["provenance"] = {key: {"commit": first, "dirty": False} for key in sigkill["modes"]}
    side_runs = {
        "corruption_campaign.py": {"seconds": 1.0, "commit": first, "dirty": False},
        "env_faults.py": {"seconds": 1.0},
    }  # an older run: no commit recorded
    check = report.Checker(str(root))
    fresh = report.render_report(sigkill, None, None, side_runs, check=check)
    assert "**[" not in fresh.split("## Corruption")[0]  # every SIGKILL row at HEAD
    _commit(root, {"patches/slimckpt/a.py": "x = 3\n"}, "code")
    text = report.render_report(sigkill, {"seed": 0}, None, side_runs, check=report.Checker(str(root)))
    lines = text.splitlines()
    quickstart = next(ln for ln in lines if ln.startswith("| slimckpt `+recipe=quickstart`"))
    verl = next(ln for ln in lines if ln.startswith("| verl 0.9.1 default"))
    merge = next(ln for ln in lines if ln.startswith("| `slimckpt merge`"))
    verl_merge = next(ln for ln in lines if ln.startswith("| verl 0.9.1 `FSDPModelMerger`"))
    assert "**[stale]**" in quickstart and "**[stale]**" in merge
    assert "**[" not in verl and "**[" not in verl_merge
    assert f"**[stale]** quickstart@keep=2: run on {first}; 1 commit(s) up to " in text
    assert f"**[stale]** merge: run on {first};" in text and "`patches/slimckpt/a.py`" in text
    assert "2 of the 4 rows below ran on code that is not HEAD's" in text
    corruption = text.split("## Corruption")[1].split("## Environment")[0]
    assert f"**[stale]** every figure of this section: run on {first};" in corruption


def test_each_row_keeps_the_commit_of_the_file_it_came_from(tmp_path, monkeypatch):
    """sigkill_*.json rows replace sigkill.json's, and bring their own commit."""
    main = _sigkill(("verl-default@keep=2", "merge"))
    for key in ("commit", "dirty"):  # an older sigkill.json: its commit only in the "source" sentence
        main.pop(key, None)
    main["source"] = "a clean export of commit 1111111aaaaa (patches/ and recipes/)"
    extra = _sigkill(("merge",))
    extra.update(command="python -m scripts.faults.reliability --modes merge", commit="2222222bbbbb", dirty=False)
    (tmp_path / "sigkill.json").write_text(json.dumps(main))
    (tmp_path / "sigkill_merge.json").write_text(json.dumps(extra))
    monkeypatch.setattr(reliability_report, "OUT_DIR", str(tmp_path))
    loaded = reliability_report.load_sigkill()
    assert loaded["provenance"] == {
        "verl-default@keep=2": {"commit": "1111111aaaaa", "dirty": False},
        "merge": {"commit": "2222222bbbbb", "dirty": False},
    }


def test_sides_names_each_side_campaign_and_refuses_others(capsys):
    """`--sides` chooses among the campaigns beside the SIGKILL one, by the names SIDES gives them;
    each names a script the renderer knows. Nothing runs with --render --no-report."""
    assert set(reliability.SIDES) == {"corruption", "damaged", "env", "ranks"}
    assert {script for script, _, _ in reliability.SIDES.values()} == set(report.SIDE_MODULES)
    assert reliability.main(["--render", "--no-report", "--sides", "env", "ranks"]) == 0
    with pytest.raises(SystemExit):
        reliability.main(["--render", "--no-report", "--sides", "everything"])
    assert "invalid choice" in capsys.readouterr().err


def test_the_rank_section_counts_the_faults_placed_at_a_commit_outcome():
    from scripts.faults.ranks_report import render, summarize

    def trial(at, fault, outcome, step, loaded):
        return {
            "trial": 0,
            "world": 2,
            "fault": fault,
            "at": at,
            "victim": 1,
            "outcome": outcome,
            "step": step,
            "loaded": loaded,
            "last_committed": loaded,
            "in_save": True,
            "named": True,
            "survivors_end_s": 3.0,
            "orphans": [],
            "locks_held": [],
        }

    trials = [
        trial("random", "kill", "exact", 2, 1),
        trial("commit-outcome", "kill", "exact", 2, 1),
        trial("commit-outcome", "stall", "exact", 3, 3),
        trial("commit-outcome", "stall", "wrong-resume", 3, 2),
    ]
    entry = {"trials": trials, "summary": summarize(trials)}
    data = {"world_sizes": [2], "timeout_s": 5, "slack_s": 15, "seed": 0, "at_commit_per_world": 1}
    text = render({**data, "modes": {"incremental-async": entry}})
    assert "3 were placed at a commit's outcome" in text and "1 bad; in 1 the relaunch resumed that very step" in text
    assert "placed at a commit's outcome" not in render(
        {**data, "modes": {"incremental-async": {**entry, "trials": trials[:1], "summary": summarize(trials[:1])}}}
    )


def test_the_rank_sections_rows_are_checked_against_head_like_the_others():
    from scripts.faults.ranks_report import LABELS, render, summarize

    trials = [
        {
            "trial": 0,
            "world": 2,
            "fault": "kill",
            "at": "random",
            "victim": 1,
            "outcome": "exact",
            "in_save": True,
            "named": True,
            "survivors_end_s": 3.0,
            "orphans": [],
            "locks_held": [],
        }
    ]
    entry = {"trials": trials, "summary": summarize(trials)}
    data = {
        "world_sizes": [2],
        "timeout_s": 5,
        "slack_s": 15,
        "seed": 0,
        "commit": "abc1234",
        "dirty": False,
        "modes": {"verl-default": entry, "incremental-sync": entry},
    }
    asked = []

    def check(prov, paths):
        asked.append((prov["commit"], paths))
        return report.Flag(report.STALE, "run on abc1234; patches changed") if "patches" in paths else None

    text = render(data, check)
    assert f"| {LABELS['incremental-sync']} **[stale]** |" in text
    assert f"| {LABELS['verl-default']} |" in text  # verl's own row runs none of slimckpt's code
    assert f"**[stale]** {LABELS['incremental-sync']}: run on abc1234; patches changed." in text
    assert {c for c, _ in asked} == {"abc1234"}
