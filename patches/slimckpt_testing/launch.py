"""One way to run a scenario on N ranks and read what it found: torchrun (gloo, CPU) starts this module
on every rank; it parses the scenario's own flags, opens the process group, calls the scenario and closes
the group; the caller reads the JSON the scenario wrote on rank 0.

    python -m torch.distributed.run --standalone --nproc_per_node N -m slimckpt_testing.launch MODULE [ARGS ...]

MODULE is a dotted module name (run from the repository root for `slimckpt_testing.scenarios.*`). It defines
    parse_args(argv) -> argparse.Namespace     its flags
    run(args) -> None                           the scenario, on the open gloo group
and may define
    PG_TIMEOUT_S          seconds a collective may wait (or pg_timeout_s(args), computed); gloo's default if unset
    BARRIER_AT_EXIT       False: no last barrier before the group closes (default True: every rank meets once
                          more, error or not, so no rank leaves while another still writes)
    HARD_EXIT             True: leave through os._exit after flushing, skipping the interpreter's teardown

From Python, `launch(nproc, module, *args, result=PATH)` runs it and returns the finished process and the
result file's JSON (None when the scenario wrote none).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

# lazy imports: torch.distributed loads on the ranks only; launch() on the caller's side stays torch-free

LAUNCHER = "slimckpt_testing.launch"


@dataclass
class Launched:
    """A finished torchrun of a scenario."""

    proc: subprocess.CompletedProcess
    result: dict | None  # the scenario's result JSON, None when it wrote none

    @property
    def output(self) -> str:
        """The ends of its stdout and stderr, for an assertion message."""
        return self.proc.stdout[-3000:] + self.proc.stderr[-6000:]


def command(nproc: int, module: str, *args: str) -> list[str]:
    """The torchrun command line that runs `module` on `nproc` ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        LAUNCHER,
        module,
        *map(str, args),
    ]


# every Python process of a launched tree prints each thread's stack on SIGABRT (and on a crash)
STACKS_ON_ABORT = {"PYTHONFAULTHANDLER": "1"}
STACKS_WAIT_S = 3.0  # for the stacks to be written before the tree is killed


def end_hung_tree(child: subprocess.Popen) -> tuple[str, str]:
    """A tree started with `start_new_session` and STACKS_ON_ABORT that ran past its time: SIGABRT to
    all of it (each process started with the environment prints its threads' stacks to stderr),
    then SIGKILL (torchrun leaves ranks behind); returns its (stdout, stderr), the stacks at the end."""
    try:
        os.killpg(child.pid, signal.SIGABRT)
        return child.communicate(timeout=STACKS_WAIT_S)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    return child.communicate()


def launch(
    nproc: int,
    module: str,
    *args: str,
    result: str | Path | None = None,
    env: dict | None = None,
    timeout: float = 300,
    cwd: str | Path | None = None,
) -> Launched:
    """Runs `module` on `nproc` ranks (env: added to this process's environment) and reads `result`.
    On timeout the whole process tree goes (torchrun leaves its ranks behind) and TimeoutExpired is raised."""
    cmd = command(nproc, module, *args)
    with subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**os.environ, **STACKS_ON_ABORT, **(env or {})},
        start_new_session=True,
    ) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = end_hung_tree(child)
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    proc = subprocess.CompletedProcess(cmd, child.returncode, out, err)
    found = None
    if result is not None and Path(result).is_file():
        found = json.loads(Path(result).read_text())
    return Launched(proc, found)


def _pg_timeout(module: ModuleType, args: argparse.Namespace) -> dict:
    seconds = module.pg_timeout_s(args) if hasattr(module, "pg_timeout_s") else getattr(module, "PG_TIMEOUT_S", None)
    return {} if seconds is None else {"timeout": datetime.timedelta(seconds=seconds)}


def run_scenario(module: ModuleType, argv: list[str]) -> None:
    """On one rank: the scenario between opening and closing the process group."""
    import torch.distributed as dist

    args = module.parse_args(argv)
    dist.init_process_group("gloo", **_pg_timeout(module, args))
    try:
        module.run(args)
    finally:
        if getattr(module, "BARRIER_AT_EXIT", True):
            dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    module = importlib.import_module(argv[0])
    run_scenario(module, argv[1:])
    if getattr(module, "HARD_EXIT", False):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
