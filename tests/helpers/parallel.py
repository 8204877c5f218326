"""How `make test` runs on every core: pytest-xdist workers (`-n auto --dist loadgroup`), one test or
group of tests at a time each.

Most tests use one core for most of their time (a fresh interpreter importing torch, one rank
waiting on the other), so one pytest process left the second core of a 2-core host idle. Run
in parallel, a test must still run once where the one-process session ran it once:
- what a module- or class-scoped fixture builds (a torchrun job, a checkpoint) is shared by that
  module's tests: those tests go to one worker, as a group named after the module;
- the session's 2-rank scenario batch (conftest's `ws2_scenarios`) is built once: its readers, in
  several modules, form one group;
- the session's verl trainer runs (tests/helpers/verl_runs.py) are started by the worker that runs
  their readers, when the first of them asks: their readers form one group, dispatched first, so
  the runs start at the session's start and go on while the other worker runs the rest.
Every other test is dispatched alone. Order (xdist keeps it with --no-loadscope-reorder): the
readers of the trainer runs, then the slow tests, then the fast ones, whose small units even out
the workers' last minutes.
"""

from __future__ import annotations

import os

import pytest

VERL_RUNS_GROUP = "verl_runs"
SCENARIO_BATCH_GROUP = "ws2_scenarios"
_SHARED_SCOPES = ("module", "class", "package")
# session-scoped fixtures each worker may build for itself, and why that is cheap; any other must be grouped
PER_WORKER_SESSION_FIXTURES = {
    "s3_server": "a SeaweedFS server on free ports starts in about a second",
    "_verl_runs_in_background": "starts nothing under xdist",
}


def worker_id() -> str | None:
    """This process's xdist worker ("gw0", ...), or None in a one-process session."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def _shares_a_fixture(item: pytest.Item) -> bool:
    """True when a fixture this test uses lives longer than the test but not as long as the session."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        definition.scope in _SHARED_SCOPES
        for definitions in info.name2fixturedefs.values()
        for definition in definitions
    )


def group_of(item: pytest.Item, reads_verl_runs: bool) -> str | None:
    """The xdist group a test must share a worker with, or None when it may go anywhere."""
    if reads_verl_runs:
        return VERL_RUNS_GROUP
    if SCENARIO_BATCH_GROUP in getattr(item, "fixturenames", ()):
        return SCENARIO_BATCH_GROUP
    if _shares_a_fixture(item):
        return item.nodeid.split("::", 1)[0]
    return None


def order_for_workers(items: list[pytest.Item], reads_verl_runs) -> list[pytest.Item]:
    """Mark each test with its group and put them in dispatch order (see the module's docstring)."""

    def rank(item: pytest.Item) -> int:
        if reads_verl_runs(item):
            return 0
        return 1 if item.get_closest_marker("slow") is not None else 2

    for item in items:
        group = group_of(item, reads_verl_runs(item))
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    return sorted(items, key=rank)
