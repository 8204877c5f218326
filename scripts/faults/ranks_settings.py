"""The rank campaign's settings, set by ranks.main before any fork and read by the save and merge trials alike
(the ranks' process group timeout, the slack a survivor gets beyond it, --keep-dirs), and what becomes of a
trial's dir once judged."""

from __future__ import annotations

import shutil

from scripts.faults.ranks_report import BAD

SLACK_S = 15.0  # beyond the group's timeout: naming the lost rank (a few heartbeats) and exiting
TIMEOUT_S = [20.0]  # the process group's timeout of the ranks (set by --timeout before any fork)
KEEP_ALL = [False]  # --keep-dirs


def unnamed(trial: dict) -> bool:
    """A fault inside a save that did not commit whose survivors' output named no lost rank."""
    return bool(trial.get("in_save")) and trial.get("last_committed") != trial.get("step") and not trial.get("named")


def keep_or_remove(trial: dict, trial_dir: str) -> dict:
    if trial["outcome"] in BAD or unnamed(trial) or KEEP_ALL[0]:
        trial["kept_dir"] = trial_dir
    else:
        shutil.rmtree(trial_dir, ignore_errors=True)
    return trial
