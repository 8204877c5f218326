import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_python(code: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter of this venv (so verl's plugin loading starts from zero)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=REPO)


@pytest.fixture
def repo() -> Path:
    return REPO


# verl trainer runs shared by the end-to-end modules (one start-up each per session)
from .verl_runs import grpo_env, incremental_run, tiny_assets  # noqa: E402,F401
