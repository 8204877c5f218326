"""tests/helpers/parallel.py: which tests `make test`'s xdist workers must run together."""

import ast
from types import SimpleNamespace

import pytest

from tests.helpers import parallel
from tests.helpers.launch import REPO
from tests.helpers.verl_runs import READS


def _item(nodeid: str, fixtures: dict[str, str], slow: bool = False):
    """A collected test's stand-in: its fixtures by name -> scope."""
    marks = []
    return SimpleNamespace(
        nodeid=nodeid,
        fixturenames=list(fixtures),
        _fixtureinfo=SimpleNamespace(
            name2fixturedefs={n: (SimpleNamespace(scope=scope),) for n, scope in fixtures.items()}
        ),
        get_closest_marker=lambda name: (object() if slow else None) if name == "slow" else None,
        add_marker=marks.append,
        marks=marks,
    )


def test_tests_sharing_a_module_fixture_the_batch_or_the_runs_are_grouped_and_the_others_go_alone():
    reads = lambda item: "incremental_run" in item.fixturenames  # noqa: E731
    built = _item("tests/a/test_x.py::test_one", {"ckpt": "module", "tmp_path": "function"}, slow=True)
    batch = _item("tests/b/test_y.py::test_two", {"ws2_scenarios": "session"}, slow=True)
    runs = _item("tests/e2e/test_z.py::test_three", {"incremental_run": "session"}, slow=True)
    alone = _item("tests/c/test_w.py::test_four", {"tmp_path": "function", "s3_server": "session"})
    ordered = parallel.order_for_workers([alone, built, batch, runs], reads)
    assert [i.nodeid for i in ordered] == [runs.nodeid, built.nodeid, batch.nodeid, alone.nodeid]
    groups = {i.nodeid: [m.args[0] for m in i.marks] for i in ordered}
    assert groups == {
        runs.nodeid: [parallel.VERL_RUNS_GROUP],
        built.nodeid: ["tests/a/test_x.py"],
        batch.nodeid: [parallel.SCENARIO_BATCH_GROUP],
        alone.nodeid: [],
    }


def _session_fixtures() -> set[str]:
    names = set()
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and any(
                    kw.arg == "scope" and getattr(kw.value, "value", None) == "session" for kw in deco.keywords
                ):
                    names.add(node.name)
    return names


def test_every_session_fixture_is_built_once_or_cheap_to_build_per_worker():
    """A session fixture that starts torchrun or a trainer, built once per worker, would be built twice: it must
    have a group in parallel.py or be listed there as cheap."""
    known = {"verl_pool", parallel.SCENARIO_BATCH_GROUP, *READS, *parallel.PER_WORKER_SESSION_FIXTURES}
    unknown = _session_fixtures() - known
    assert not unknown, f"session fixtures without an xdist group in tests/helpers/parallel.py: {sorted(unknown)}"


@pytest.mark.parametrize("worker", [None, "gw1"])
def test_the_worker_id_is_xdists(monkeypatch, worker):
    if worker is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    assert parallel.worker_id() == worker
