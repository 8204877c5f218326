"""Runs of verl 0.9.1's real trainer (`python -m verl.trainer.main_ppo` through scripts/train_small.sh,
CPU, the 78k-parameter tiny Llama) for the end-to-end modules, started in the background when the
session starts.

Why: a run spends ~50 s in Ray and verl start-up on 2 cores before its first step, and uses about one
core meanwhile (Ray actors start one after another). So the session's runs go one at a time in the
background from its first test on, while the other tests run, and the modules that read them
(tests/e2e/test_cpu_e2e.py, tests/e2e/test_flowrl_e2e.py, tests/e2e/test_incremental_e2e.py, ...) are moved
to the end of the session (conftest's pytest_collection_modifyitems); their fixtures wait for the runs they
read, and from the first such wait two runs go at once (RunPool). Only the runs that the selected tests
read are started: none under `-m "not slow"` (`make test-fast`), MAKE_TEST_RUNS under `-m "not trainer"`
(`make test`), the rest under `-m trainer` (`make test-trainer`).

The runs (RUNS, in the order they start; a resumed run starts after the run it resumes):
  grpo_first    GRPO, 2 ranks, +recipe=intermediate, steps 1-3 saving every step
  grpo_resume   +recipe=quickstart, resume_mode=auto from grpo_first's step 3 to step 4
  incremental   +recipe=incremental with async_save, steps 1-4 never stopped: checked by
                test_incremental_e2e, and the uninterrupted reference of the GRPO runs above
  ppo           PPO with a critic and KL in the reward, 1 rank, +recipe=quickstart, 2 steps
  flowrl        FlowRL, 2 ranks, verl's own checkpoint (+hf_model) and wandb (offline), 2 steps, validated at step 2
  ppo_warmup_verl  PPO with KL in the reward, 1 rank, trainer.critic_warmup=2 (the actor first updates at
                step 2), 3 steps saving every step with verl's own checkpoint
  ppo_warmup    the same with +recipe=incremental: its step-1 save precedes the actor's first update; both
                must log the same numbers, so they also show that two PPO runs repeat bit for bit
  incremental_resumed   +recipe=incremental resumed from incremental's step 2 to step 4
  adopt_verl    GRPO, 2 ranks, no recipe, verl's default checkpoint dir (CKPT_DIR=""): steps 1-2
  adopt_<recipe>  +recipe=quickstart / intermediate / incremental added to a relaunch of a copy of
                adopt_verl's checkpoints (resume_mode=auto, verl's default dir moved by the recipe)
  adopt_plain_after_<recipe>  the recipe dropped again on a relaunch of that copy: it must stop
  retention, retention_resumed  keep_optimizer_last / keep_best, then a resume of a step without optimizer
  convert_back  incremental's step 2 through `slimckpt convert --to verl --world-size 2`, resumed without
                the recipe (verl's own load) to step 4
  s3_killed, s3_resumed  +recipe=incremental with trainer.default_local_dir=s3://... (the session's SeaweedFS),
                SIGKILLed after its step-3 commit, then resumed from the bucket to step 4
All share one tiny model and data set (built by train_small.sh in the first run).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers.launch import REPO

SCRIPT = REPO / "scripts" / "train_small.sh"
# one run takes ~1 minute alone, up to ~2 beside the other tests; a host shared with other jobs may need more
RUN_TIMEOUT_S = int(os.environ.get("VERL_RUN_TIMEOUT_S", "400"))
CONSOLE = "trainer.logger=[console]"  # no wandb start-up where the test does not read wandb
_STEP_LINE = re.compile(r"step:(\d+) - (.*)$")
# the recipe keeps 2 steps, the optimizer in the newest only: runs that resume or convert an older step keep all
KEEP_ALL = (
    "trainer.max_actor_ckpt_to_keep=null",
    "trainer.max_critic_ckpt_to_keep=null",
    "actor_rollout_ref.actor.checkpoint.keep_optimizer_last=null",
    "critic.checkpoint.keep_optimizer_last=null",
)
INCREMENTAL_ASYNC = (
    "+recipe=incremental",
    *KEEP_ALL,
    "actor_rollout_ref.actor.checkpoint.async_save=true",
    "trainer.save_freq=1",
    "trainer.total_training_steps=4",
    CONSOLE,
)


def step_metrics(text: str) -> dict[int, dict[str, str]]:
    """verl's console logger: `step:N - key:value - key:value ...` lines, merged per step (a
    checkpoint callback's `ckpt/*` line comes before the step's own line)."""
    steps: dict[int, dict[str, str]] = {}
    for line in text.splitlines():
        match = _STEP_LINE.search(line)
        if match:
            steps.setdefault(int(match.group(1)), {}).update(
                kv.rsplit(":", 1) for kv in match.group(2).split(" - ") if ":" in kv
            )
    return steps


@dataclass
class Spec:
    """One train_small.sh run: its arguments (`{root}` is the pool's directory) and environment."""

    args: tuple[str, ...]
    env: dict = field(default_factory=dict)
    after: str | None = None  # the run whose checkpoints this one resumes from
    copy: tuple[str, str] | None = None  # (from, to) under the pool's directory, copied before the run
    fails: bool = False  # it must exit non-zero (a run that refuses to start)
    prepare: tuple[str, ...] = ()  # a `slimckpt` command run before it (its output goes to the run's log)
    s3: bool = False  # `{s3}` in its arguments is a prefix on the session's S3 server, its AWS_* in the env
    kill_at: str | None = None  # SIGKILL the whole run (driver, Ray, ranks) once its output has this line


GRPO_ENV = {"NPROC": "2", "ALGO": "grpo"}
GRPO_COMMON = (
    "trainer.save_freq=1",
    CONSOLE,
    "trainer.default_local_dir={root}/grpo_ckpt",
    "trainer.rollout_data_dir={root}/grpo_rollouts",
)
# verl's own save and +recipe=incremental's of one PPO config (critic, KL in the reward) must log the same numbers
# (overrides/cluster/cpu.yaml's critic seed makes two runs repeat bit for bit)
PPO_WARMUP = (
    "algo=ppo",
    CONSOLE,
    "algorithm.use_kl_in_reward=true",
    "trainer.critic_warmup=2",
    "trainer.total_training_steps=3",
    "trainer.save_freq=1",
)
RUNS = {
    "grpo_first": Spec(("+recipe=intermediate", *GRPO_COMMON, "trainer.total_training_steps=3"), GRPO_ENV),
    "grpo_resume": Spec(
        ("+recipe=quickstart", *GRPO_COMMON, "trainer.total_training_steps=4", "trainer.resume_mode=auto"),
        GRPO_ENV,
        after="grpo_first",
    ),
    "incremental": Spec(
        (
            *INCREMENTAL_ASYNC,
            "trainer.default_local_dir={root}/incremental_ckpt",
            "trainer.rollout_data_dir={root}/incremental_rollouts",
        ),
        GRPO_ENV,
    ),
    "ppo": Spec(
        (
            "algo=ppo",
            "+recipe=quickstart",
            CONSOLE,
            "algorithm.use_kl_in_reward=true",
            "trainer.total_training_steps=2",
            "trainer.save_freq=2",
            "trainer.default_local_dir={root}/ppo_ckpt",
        ),
        {"NPROC": "1"},
    ),
    "flowrl": Spec(
        (
            "algo=flowrl",
            "trainer.total_training_steps=2",
            "trainer.save_freq=1",
            "trainer.test_freq=2",
            "trainer.default_local_dir={root}/flowrl_ckpt",
            # verl's own hf_model save as well, to see FlowRL's head left out of it
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        ),
        {"NPROC": "2", "WANDB_DIR": "{root}/flowrl_wandb"},
    ),
    # the actor's first save precedes its first update (critic_warmup): verl's own save, then the recipe's
    "ppo_warmup_verl": Spec(PPO_WARMUP + ("trainer.default_local_dir={root}/ppo_warmup_verl_ckpt",), {"NPROC": "1"}),
    "ppo_warmup": Spec(
        ("+recipe=incremental", *KEEP_ALL, *PPO_WARMUP, "trainer.default_local_dir={root}/ppo_warmup_ckpt"),
        {"NPROC": "1"},
    ),
    "incremental_resumed": Spec(
        (
            *INCREMENTAL_ASYNC,
            "trainer.default_local_dir={root}/incremental_resumed_ckpt",
            "trainer.resume_mode=resume_path",
            "trainer.resume_from_path={root}/incremental_ckpt/global_step_2",
        ),
        GRPO_ENV,
        after="incremental",
    ),
}


def _adopt(experiment: str, *args: str, steps: int) -> tuple[str, ...]:
    return (
        "trainer.project_name=adopt",
        f"trainer.experiment_name={experiment}",
        CONSOLE,
        "trainer.save_freq=1",
        f"trainer.total_training_steps={steps}",
        f"trainer.rollout_data_dir={{root}}/adopt_{experiment}_rollouts",
        *args,
    )


ADOPT_ENV = {**GRPO_ENV, "CKPT_DIR": ""}  # verl's default dir: checkpoints/adopt/<experiment> under the pool's
ADOPT_RECIPES = ("quickstart", "intermediate", "incremental")
RUNS["adopt_verl"] = Spec(_adopt("verl", steps=2), ADOPT_ENV)
for _recipe in ADOPT_RECIPES:
    # incremental restores the optimizer too: one more step shows the update after the resume is exact
    RUNS[f"adopt_{_recipe}"] = Spec(
        _adopt(_recipe, f"+recipe={_recipe}", steps=4 if _recipe == "incremental" else 3),
        ADOPT_ENV,
        after="adopt_verl",
        copy=("checkpoints/adopt/verl", f"checkpoints/adopt/{_recipe}"),
    )
for _recipe in ("quickstart", "incremental"):
    RUNS[f"adopt_plain_after_{_recipe}"] = Spec(
        _adopt(_recipe, steps=5), ADOPT_ENV, after=f"adopt_{_recipe}", fails=True
    )
# retention that fits a large disk: the optimizer in the newest step only, the best 3 by the score kept
# as well (steps 1 and 2 then always stay, without their optimizer); then a resume of step 1 (model-only)
RETENTION = (
    "+recipe=incremental",
    CONSOLE,
    "trainer.save_freq=1",
    "trainer.total_training_steps=4",
    "trainer.max_actor_ckpt_to_keep=2",
    "actor_rollout_ref.actor.checkpoint.keep_optimizer_last=1",
    "actor_rollout_ref.actor.checkpoint.keep_best=3",
    "actor_rollout_ref.actor.checkpoint.best_metric=critic/score/mean",
)
RUNS["retention"] = Spec((*RETENTION, "trainer.default_local_dir={root}/retention_ckpt"), GRPO_ENV)
RUNS["retention_resumed"] = Spec(
    (
        *RETENTION[:3],
        "trainer.total_training_steps=2",
        "trainer.default_local_dir={root}/retention_resumed_ckpt",
        "trainer.resume_mode=resume_path",
        "trainer.resume_from_path={root}/retention_ckpt/global_step_1",
    ),
    GRPO_ENV,
    after="retention",
)
# leaving the incremental tier: its step 2 converted back to verl's rank files for 2 ranks, then a run
# without the recipe (verl's own checkpoint load) resumes it to step 4, as `incremental` went on
RUNS["convert_back"] = Spec(
    (
        "trainer.total_training_steps=4",
        CONSOLE,
        "trainer.resume_mode=auto",
        "trainer.default_local_dir={root}/converted_ckpt",
        "trainer.rollout_data_dir={root}/converted_rollouts",
    ),
    GRPO_ENV,
    after="incremental",
    prepare=(
        "convert",
        "{root}/incremental_ckpt/global_step_2",
        "--to",
        "verl",
        "--world-size",
        "2",
        "--target_dir",
        "{root}/converted_ckpt",
        "--no_progress",
    ),
)
# +recipe=incremental saving to object storage with its one argument (the session's SeaweedFS): `incremental`'s
# steps with sync saves and max_actor_ckpt_to_keep=1, SIGKILLed once step 3 is committed (retention has deleted
# step 1 from the bucket by then); then resume_mode=auto from the same URL to step 4
S3_RUN = (
    "+recipe=incremental",
    "trainer.save_freq=1",
    "trainer.total_training_steps=4",
    "trainer.max_actor_ckpt_to_keep=1",
    CONSOLE,
    "trainer.default_local_dir={s3}/ckpt",
)
RUNS["s3_killed"] = Spec(S3_RUN, GRPO_ENV, s3=True, kill_at="committed step 3 at s3://")
RUNS["s3_resumed"] = Spec((*S3_RUN, "trainer.resume_mode=auto"), GRPO_ENV, s3=True, after="s3_killed")
# which runs a fixture reads (with the runs they resume from): decides what a session starts
READS = {
    "grpo_runs": ("grpo_first", "grpo_resume"),
    "incremental_run": ("incremental",),
    "incremental_resumed": ("incremental", "incremental_resumed"),
    "ppo_run": ("ppo",),
    "flowrl_run": ("flowrl",),
    "ppo_warmup": ("ppo_warmup_verl", "ppo_warmup"),
    "adopt_runs": tuple(name for name in RUNS if name.startswith("adopt_")),
    "retention_runs": ("retention", "retention_resumed"),
    "convert_back_run": ("incremental", "convert_back"),
    "s3_runs": ("incremental", "s3_killed", "s3_resumed"),
}

# the runs `make test` starts, for the one trainer test it keeps (tests/e2e/test_incremental_e2e.py): ~75 CPU-seconds
# each; a test that reads any other run belongs to `make test-trainer` and carries the `trainer` marker (conftest
# refuses the session otherwise)
MAKE_TEST_RUNS = frozenset(READS["incremental_resumed"])


class RunPool:
    """Runs the needed RUNS in the background, in RUNS order, a run that resumes another only after
    it; `wait(name)` blocks until that one ended and returns its output, or fails the test with the
    output's tail.

    One run at a time while the other tests run: they keep both cores busy, and some of them time
    collectives in seconds. The first `wait` means those tests are done (the tests that read runs go
    last), and from then on two runs go at once: one run alone leaves a core idle (its Ray actors
    start one after another), which was the last minutes of every session."""

    WIDTH_WHILE_OTHERS_RUN = 1
    WIDTH_ONCE_READ = 2

    def __init__(self, root: Path, needed: set[str], s3_server=None) -> None:
        self.root = root
        self.s3 = s3_server  # the session's SeaweedFS (conftest's s3_server), for the runs that save to it
        self.s3_root = s3_server.url("verl_runs") if s3_server is not None else None
        self.order = [name for name in RUNS if name in needed]
        self.done = {name: threading.Event() for name in self.order}
        self.outcome: dict[str, str | None] = {}  # name -> None when it passed, else why it failed
        self.snapshots: dict[str, dict] = {}
        self.width = self.WIDTH_WHILE_OTHERS_RUN
        self._procs: dict[str, subprocess.Popen] = {}
        self._running: set[str] = set()
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._dispatch, name="verl-runs", daemon=True)

    def start(self) -> None:
        if self.order:
            atexit.register(self.stop)
            self._thread.start()

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def wait(self, name: str) -> str:
        assert name in self.done, f"{name} was not started: add the fixture that reads it to READS"
        with self._changed:
            self.width = max(self.width, self.WIDTH_ONCE_READ)
            self._changed.notify_all()
        self.done[name].wait()
        text = self.log(name).read_text(errors="replace") if self.log(name).exists() else ""
        assert self.outcome[name] is None, f"verl run {name}: {self.outcome[name]}\n{text[-6000:]}"
        return text

    def stop(self) -> None:
        """Kill the runs in flight (the session ended, or was interrupted) and start no other."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        for name in list(self._procs):
            self._kill(name)

    def _kill(self, name: str) -> None:
        proc = self._procs.get(name)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # train_small.sh, verl's driver and the Ray cluster it started
            proc.wait()

    def _ready(self, pending: list[str]) -> str | None:
        """The first pending run that may start now: the run it resumes from (if any) has ended."""
        for name in pending:
            after = RUNS[name].after
            if after is None or after not in self.done or self.done[after].is_set():
                return name
        return None

    def _dispatch(self) -> None:
        self._build_tiny_assets()
        pending = list(self.order)
        while pending:
            with self._changed:
                name = None
                while not self._stop.is_set():
                    name = self._ready(pending) if len(self._running) < self.width else None
                    if name is not None:
                        break
                    self._changed.wait()
                if self._stop.is_set():
                    break
                pending.remove(name)
                self._running.add(name)
            threading.Thread(target=self._run_one, args=(name,), name=f"verl-run-{name}", daemon=True).start()
        for name in pending:  # the session ended first
            self.outcome[name] = "not run: the session ended first"
            self.done[name].set()

    def _build_tiny_assets(self) -> None:
        """The model and data every run shares, built once before two runs could build them at once
        (train_small.sh's own build then finds them and keeps them)."""
        out = self.root / "tiny_assets"
        cmd = [sys.executable, "-m", "slimckpt_testing.tiny", "--out", str(out), "--model", "llama", "--reuse"]
        cmd += ["--warmup-steps", "0", "--max-operand", "4"]
        with open(self.root / "tiny_assets.log", "w") as log:
            # builds a 78k-parameter model and a few hundred rows in seconds; a run that needs them reports a failure
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=RUN_TIMEOUT_S)

    def _run_one(self, name: str) -> None:
        spec = RUNS[name]
        try:
            if spec.after and self.outcome.get(spec.after) is not None:
                self.outcome[name] = f"not run: it resumes from {spec.after}, which failed"
            elif self._stop.is_set():
                self.outcome[name] = "not run: the session ended first"
            else:
                if spec.copy:
                    shutil.copytree(self.root / spec.copy[0], self.root / spec.copy[1])
                self.outcome[name] = self._run(name, spec)
                if name == "grpo_first":  # what the stopped run left, before the resumed run adds to it
                    ckpt = self.root / "grpo_ckpt"
                    self.snapshots[name] = {
                        int(p.name.rsplit("_", 1)[1]): sorted(os.listdir(p)) for p in ckpt.glob("global_step_*")
                    }
        except Exception as exc:  # noqa: BLE001 - its readers fail with it instead of waiting forever
            self.outcome[name] = f"could not run: {exc!r}"
        finally:
            self.done[name].set()
            with self._changed:
                self._running.discard(name)
                self._changed.notify_all()

    def _run(self, name: str, spec: Spec) -> str | None:
        args = [a.format(root=self.root, s3=self.s3_root) for a in spec.args]
        # SLIMCKPT_CPU_FORCE: these tests are about the CPU path, also where a GPU is visible
        env = {
            **os.environ,
            "WANDB_MODE": "offline",
            "RAY_DEDUP_LOGS": "0",
            "SLIMCKPT_CPU_FORCE": "1",
            "TINY_ASSETS": str(self.root / "tiny_assets"),
            **{k: v.format(root=self.root) for k, v in spec.env.items()},
        }
        env.pop("RAY_ADDRESS", None)
        if spec.s3:
            env = {k: v for k, v in env.items() if not k.startswith("AWS_")}
            env.update(self.s3.env)
        if "WANDB_DIR" in env:
            os.makedirs(env["WANDB_DIR"], exist_ok=True)
        with open(self.log(name), "w") as out:
            if spec.prepare:
                cmd = [sys.executable, "-m", "slimckpt.cli", *(a.format(root=self.root) for a in spec.prepare)]
                out.write(f"$ {' '.join(cmd)}\n")
                out.flush()
                done = subprocess.run(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.root, timeout=RUN_TIMEOUT_S
                )
                if done.returncode != 0:
                    return f"slimckpt {' '.join(cmd[3:])} exited {done.returncode}"
            proc = self._procs[name] = subprocess.Popen(
                ["bash", str(SCRIPT), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.root,
                start_new_session=True,
            )
            try:
                if spec.kill_at is not None:
                    return self._kill_at(name, proc, spec.kill_at)
                code = proc.wait(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._kill(name)
                return f"killed after {RUN_TIMEOUT_S} s"
        if self._stop.is_set():
            return "killed: the session ended first"
        if spec.fails:
            return None if code != 0 else f"train_small.sh {' '.join(args)} exited 0, and it must refuse to start"
        return None if code == 0 else f"train_small.sh {' '.join(args)} exited {code}"

    def _kill_at(self, name: str, proc: subprocess.Popen, line: str) -> str | None:
        """SIGKILL the run's process group once `line` is in its output (None), or say why it never was."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline and not self._stop.is_set():
            if line in self.log(name).read_text(errors="replace"):
                self._kill(name)
                return None
            if proc.poll() is not None:
                return f"exited {proc.returncode} before {line!r} was in its output"
            time.sleep(0.2)
        self._kill(name)
        return "killed: the session ended first" if self._stop.is_set() else f"no {line!r} within {RUN_TIMEOUT_S} s"


def needed_runs(items) -> set[str]:
    """The runs that the fixtures of these test items read."""
    names = {f for item in items for f in getattr(item, "fixturenames", ())}
    return {run for fixture, runs in READS.items() if fixture in names for run in runs}


@pytest.fixture(scope="session")
def verl_pool(request, tmp_path_factory) -> RunPool:
    needed = needed_runs(request.session.items)
    server = request.getfixturevalue("s3_server") if any(RUNS[n].s3 for n in needed) else None
    pool = RunPool(tmp_path_factory.mktemp("verl_runs"), needed, server)
    pool.start()
    yield pool
    pool.stop()


@dataclass
class Run:
    ckpt: Path  # its trainer.default_local_dir
    text: str  # its output
    rollouts: Path | None = None  # its trainer.rollout_data_dir
    wandb: Path | None = None  # its WANDB_DIR


@dataclass
class StopAndResume:
    ckpt: Path  # both runs' trainer.default_local_dir
    first: str  # the stopped run's output
    resumed: str  # the resumed run's output
    after_first: dict[int, list[str]]  # step -> entries of global_step_<step> when the first run ended
    rollouts: Path  # both runs' trainer.rollout_data_dir


@pytest.fixture(scope="session")
def grpo_runs(verl_pool) -> StopAndResume:
    first, resumed = verl_pool.wait("grpo_first"), verl_pool.wait("grpo_resume")
    return StopAndResume(
        verl_pool.root / "grpo_ckpt",
        first,
        resumed,
        verl_pool.snapshots["grpo_first"],
        verl_pool.root / "grpo_rollouts",
    )


@pytest.fixture(scope="session")
def incremental_run(verl_pool) -> Run:
    text = verl_pool.wait("incremental")
    return Run(verl_pool.root / "incremental_ckpt", text, rollouts=verl_pool.root / "incremental_rollouts")


@pytest.fixture(scope="session")
def incremental_resumed(verl_pool) -> Run:
    return Run(verl_pool.root / "incremental_resumed_ckpt", verl_pool.wait("incremental_resumed"))


@pytest.fixture(scope="session")
def ppo_run(verl_pool) -> Run:
    return Run(verl_pool.root / "ppo_ckpt", verl_pool.wait("ppo"))


@pytest.fixture(scope="session")
def ppo_warmup(verl_pool) -> tuple[Run, Run]:
    """PPO whose actor is first saved before its first update: verl's own save, then +recipe=incremental."""
    return (
        Run(verl_pool.root / "ppo_warmup_verl_ckpt", verl_pool.wait("ppo_warmup_verl")),
        Run(verl_pool.root / "ppo_warmup_ckpt", verl_pool.wait("ppo_warmup")),
    )


@pytest.fixture(scope="session")
def flowrl_run(verl_pool) -> Run:
    return Run(verl_pool.root / "flowrl_ckpt", verl_pool.wait("flowrl"), wandb=verl_pool.root / "flowrl_wandb")


@pytest.fixture(scope="session")
def adopt_runs(verl_pool) -> dict[str, Run]:
    """Every adopt_* run by name; `ckpt` is its experiment's verl default dir."""
    runs = {}
    for name in READS["adopt_runs"]:
        experiment = name.rsplit("_", 1)[1]
        runs[name] = Run(
            verl_pool.root / "checkpoints" / "adopt" / experiment,
            verl_pool.wait(name),
            rollouts=verl_pool.root / f"adopt_{experiment}_rollouts",
        )
    return runs


@pytest.fixture(scope="session")
def convert_back_run(verl_pool) -> Run:
    """`incremental`'s step 2 converted to verl's format (2 ranks) and resumed without the recipe to step 4."""
    return Run(verl_pool.root / "converted_ckpt", verl_pool.wait("convert_back"))


@dataclass
class S3Runs:
    url: str  # both runs' trainer.default_local_dir
    killed: str  # the output of the run SIGKILLed after its step-3 commit
    resumed: str  # the output of its resume
    cwd: Path  # where both ran (no local copy of the URL may appear there)
    server: object  # the session's S3 server (slimckpt_testing.s3_server.S3Server)


@pytest.fixture(scope="session")
def s3_runs(verl_pool) -> S3Runs:
    """`S3_RUN` killed after its step-3 commit, then resumed from the bucket to step 4."""
    killed, resumed = verl_pool.wait("s3_killed"), verl_pool.wait("s3_resumed")
    return S3Runs(f"{verl_pool.s3_root}/ckpt", killed, resumed, verl_pool.root, verl_pool.s3)


@pytest.fixture(scope="session")
def retention_runs(verl_pool) -> tuple[Run, Run]:
    """+recipe=incremental with keep_optimizer_last=1 and keep_best, then a resume of a step without optimizer."""
    return (
        Run(verl_pool.root / "retention_ckpt", verl_pool.wait("retention")),
        Run(verl_pool.root / "retention_resumed_ckpt", verl_pool.wait("retention_resumed")),
    )
