"""Runs of verl 0.9.1's real trainer (`python -m verl.trainer.main_ppo` through scripts/train_small.sh,
CPU, the 78k-parameter tiny Llama) shared by the end-to-end test modules.

Each run pays ~50 s of Ray and verl start-up on 2 cores before its first step (a step takes
seconds), so a run that several modules read is started once per session: the tiny model and
data (built by train_small.sh on first use, read-only afterwards), and the uninterrupted GRPO run
with +recipe=incremental and async_save, which tests/test_incremental_e2e.py checks and resumes
and tests/test_cpu_e2e.py uses as the uninterrupted reference of its stop + resume.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "train_small.sh"
RUN_TIMEOUT_S = 300
CONSOLE = "trainer.logger=[console]"  # no wandb start-up in tests
_STEP_LINE = re.compile(r"step:(\d+) - (.*)$")

# the incremental tier saving every step in the background; 4 steps, so that the stop + resume
# runs (tests/test_cpu_e2e.py: stopped after 3, resumed to 4; tests/test_incremental_e2e.py:
# resumed from step 2) each have an uninterrupted step to compare their resumed steps with
INCREMENTAL_ASYNC = ("+recipe=incremental", "actor_rollout_ref.actor.checkpoint.async_save=true",
                     "trainer.save_freq=1", "trainer.total_training_steps=4", CONSOLE)


def train_small(log: Path, *args: str, **env: str) -> str:
    """Run scripts/train_small.sh; return its output (also written to `log`), fail with its tail."""
    # SLIMCKPT_CPU_FORCE: these tests are about the CPU path, also where a GPU is visible
    full_env = {**os.environ, "WANDB_MODE": "offline", "RAY_DEDUP_LOGS": "0", "SLIMCKPT_CPU_FORCE": "1", **env}
    full_env.pop("RAY_ADDRESS", None)
    with open(log, "w") as out:
        proc = subprocess.run(["bash", str(SCRIPT), *args], stdout=out, stderr=subprocess.STDOUT,
                              env=full_env, cwd=log.parent, timeout=RUN_TIMEOUT_S)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"train_small.sh {' '.join(args)} exited {proc.returncode}:\n{text[-6000:]}"
    return text


def step_metrics(text: str) -> dict[int, dict[str, str]]:
    """verl's console logger: one `step:N - key:value - key:value ...` line per step."""
    steps = {}
    for line in text.splitlines():
        match = _STEP_LINE.search(line)
        if match:
            steps[int(match.group(1))] = dict(kv.rsplit(":", 1) for kv in match.group(2).split(" - ") if ":" in kv)
    return steps


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> Path:
    """Where train_small.sh builds the tiny model and data once for every run of the session."""
    return tmp_path_factory.mktemp("tiny") / "assets"


@pytest.fixture(scope="session")
def grpo_env(tiny_assets) -> dict:
    return {"TINY_ASSETS": str(tiny_assets), "NPROC": "2", "ALGO": "grpo"}


@dataclass
class Run:
    work: Path
    ckpt: Path
    rollouts: Path
    text: str


@pytest.fixture(scope="session")
def incremental_run(tmp_path_factory, grpo_env) -> Run:
    """GRPO on 2 ranks, +recipe=incremental with async_save, 4 steps saving every step, never stopped;
    verl's rollout dump of every step (trainer.rollout_data_dir) in `rollouts`."""
    work = tmp_path_factory.mktemp("incremental_e2e")
    ckpt, rollouts = work / "ckpt", work / "rollouts"
    text = train_small(work / "first.log", *INCREMENTAL_ASYNC, f"trainer.default_local_dir={ckpt}",
                       f"trainer.rollout_data_dir={rollouts}", **grpo_env)
    return Run(work, ckpt, rollouts, text)
