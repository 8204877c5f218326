"""The repository root, and the one way a test starts ranks: `torchrun` (any module, e.g. the merge's
CLI) and `scenario` (a scenario module on N ranks through slimckpt_testing.launch, its output kept)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# a few ranks importing torch and verl (10-20 s here), then a tiny job; 300 s is a hang
TIMEOUT_S = 300


def torchrun(
    nproc: int, args: list[str], timeout: int = TIMEOUT_S, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node nproc <args>` from the repository root, killed whole on a hang."""
    from .merge_helpers import run  # merge_helpers imports REPO from here

    return run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args],
        env=env,
        timeout=timeout,
    )


def scenario(
    nproc: int,
    module: str,
    *args: str,
    timeout: int = TIMEOUT_S,
    env: dict | None = None,
    log_level: str = "WARNING",
    check: bool = True,
) -> subprocess.CompletedProcess:
    """A scenario module's `run(args)` on `nproc` ranks (slimckpt_testing.launch), one thread each."""
    from slimckpt_testing.launch import launch

    run = launch(
        nproc,
        module,
        *args,
        timeout=timeout,
        cwd=REPO,
        env={"OMP_NUM_THREADS": "1", "SLIMCKPT_LOG_LEVEL": log_level, **(env or {})},
    )
    if check:
        assert run.proc.returncode == 0, run.output
    return run.proc
