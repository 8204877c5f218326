"""The launchers' --dry-run prints `slimckpt plan` for their own composed configuration, before any GPU:
per-rank and per-node host memory, device memory a save adds, blocked seconds per save against the
rollout window, disk per step with retention, and one verdict line per save (fits, or what to change).
The shipped 70B configuration (overrides/size/70b.yaml, cluster 4x8, the launcher's FSDP2) is planned
with every recipe, on nodes of 2 TiB (a DGX H800's host memory; NODE_MEMORY_GB)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from slimckpt.plan.node import auto_budget
from tests.helpers.launch import REPO

TRAIN_70B = REPO / "scripts" / "train_70b.sh"
TRAIN_SMALL = REPO / "scripts" / "train_small.sh"
NODE_GIB = 2048
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


def launcher_argv(script: Path, *args: str, env: dict | None = None) -> list[str]:
    """The exact arguments the launcher hands `slimckpt dryrun` (PYTHON=echo prints them)."""
    full = {**os.environ, "PYTHON": "echo", **(env or {})}
    for knob in ("NNODES", "GPUS_PER_NODE", "MODEL_PATH", "ALGO"):
        full.pop(knob, None)
    out = (
        subprocess.run(
            ["bash", str(script), "--dry-run", *args],
            env=full,
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
            # PYTHON=echo: bash alone runs, in well under a second; 60 s is a hang
            timeout=60,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    argv = shlex.split(out)
    assert argv[:3] == ["-m", "slimckpt.cli", "dryrun"] and "--plan" in argv
    return argv[3:]


def dry_run(argv: list[str], capsys) -> tuple[int, str, str]:
    from slimckpt.plan.dryrun_cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def verdicts(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("plan: ")]


NODE_ROW = re.compile(
    r"\(as composed\)\s+(?P<rank>[\d.]+ \w+)\s+(?P<node>[\d.]+ \w+)\s+(?P<budget>[\d.]+ \w+)\s+"
    r"(?P<device>0|[\d.]+ \w+)\s+(?P<blocked>[\d.]+ s|-)\s+(?P<fits>yes|NO)$",
    re.M,
)


def node_row(err: str) -> dict[str, str]:
    """The run's row of the plan's per-node table."""
    rows = [m.groupdict() for m in NODE_ROW.finditer(err)]
    assert len(rows) == 1, err[-3000:]
    return rows[0]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_shipped_70b_configuration_fits_with_every_recipe(recipe, capsys):
    argv = launcher_argv(TRAIN_70B, "--no-print", f"+recipe={recipe}", env={"NODE_MEMORY_GB": str(NODE_GIB)})
    code, out, err = dry_run(argv, capsys)
    assert code == 0 and "config OK" in out, err[-2000:]
    assert "=== slimckpt plan for this configuration" in err
    assert "FSDP2, world size 32" in err  # the launcher's strategy, 4 nodes x 8
    # what verl's offload keeps on the host, per rank, for the PPO actor and critic
    assert "actor params (fp32)" in err and "critic AdamW state" in err
    assert "peak disk while a step is written" in err
    own = [v for v in verdicts(err) if "(as composed)" in v]
    assert len(own) == 1 and own[0].endswith(": fits"), own
    host, node = (float(x) for x in re.search(r"host ([\d.]+) of (\d+) GiB per node", own[0]).groups())
    assert host <= node == NODE_GIB
    row = node_row(err)
    assert "device added / rank" in err and row["device"] == "0" and row["fits"] == "yes", row


@pytest.mark.slow
def test_incremental_stream_mode_blocks_under_a_second_under_offload(capsys):
    argv = launcher_argv(TRAIN_70B, "--no-print", "+recipe=incremental", env={"NODE_MEMORY_GB": str(NODE_GIB)})
    code, _, err = dry_run(argv, capsys)
    assert code == 0
    stream = [v for v in verdicts(err) if "async_save=stream" in v]
    assert len(stream) == 1
    blocked = float(re.search(r"blocked ([\d.]+) s per save", stream[0]).group(1))
    # the launcher offloads params and optimizer: the writer reads the offload's host copies, so the
    # 60 s rollout window outlasts the write and the next step copies nothing
    assert blocked < 1.0 and stream[0].endswith(": fits"), stream[0]
    # the recipe's budget is auto: half the node less the offloaded copies, over 8 ranks
    resident = re.search(r"held per rank between steps by verl's offload: (.*)", err).group(1)
    held = sum(float(x) for x in re.findall(r"([\d.]+) GiB", resident))
    budget = float(node_row(err)["budget"].split()[0])
    expected = auto_budget(NODE_GIB * 2**30, 8, int(held * 2**30)) / 2**30
    assert abs(budget - expected) < 0.05, (budget, expected)


@pytest.mark.slow
def test_fsdp1_is_refused_on_paper_with_the_fix(capsys):
    argv = launcher_argv(
        TRAIN_70B,
        "--no-print",
        "+recipe=incremental",
        "actor_rollout_ref.actor.strategy=fsdp",
        "critic.strategy=fsdp",
        env={"NODE_MEMORY_GB": str(NODE_GIB)},
    )
    code, _, err = dry_run(argv, capsys)
    assert code == 0 and "FSDP1, world size 32" in err
    own = next(v for v in verdicts(err) if "(as composed)" in v)
    # Qwen2-72B: 12 bytes x 72.7e9 parameters / 32 GPUs
    assert "DOES NOT FIT" in own and "the save adds 25.4 GiB on each accelerator" in own and "strategy=fsdp2" in own


@pytest.mark.slow
def test_launcher_dry_run_prints_the_plan_after_the_config(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "NODE_MEMORY_GB": str(NODE_GIB), "DISK_GBPS": "20"}
    for knob in ("NNODES", "GPUS_PER_NODE", "MODEL_PATH", "ALGO"):
        env.pop(knob, None)
    proc = subprocess.run(
        ["bash", str(TRAIN_70B), "--dry-run", "+recipe=incremental"],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
        # one interpreter imports verl, composes and plans: well under a minute; 600 s is a hang
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("config OK")  # stdout stays the config
    assert "checkpoint storage 20 GB/s aggregate" in proc.stderr and "time @20 GB/s" in proc.stderr
    assert any(v.endswith(": fits") for v in verdicts(proc.stderr))


@pytest.mark.slow
def test_small_launcher_plans_its_local_tiny_model(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "TINY_ASSETS": str(tmp_path / "tiny")}
    env.pop("MODEL_PATH", None)
    proc = subprocess.run(
        ["bash", str(TRAIN_SMALL), "--dry-run", "--no-print", "+recipe=incremental"],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
        # builds the tiny assets, imports verl, composes and plans: under a minute; 600 s is a hang
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(model config: the model dir)" in proc.stderr and "FSDP2, world size 2" in proc.stderr
    assert any("(as composed)" in v for v in verdicts(proc.stderr))


def test_a_model_without_a_config_here_is_skipped_in_one_line(capsys):
    from slimckpt.plan.dryrun import Assumptions, run

    code = run(
        [
            "+size=70b",
            "+cluster=4x8",
            "+algo=grpo",
            "+recipe=quickstart",
            "actor_rollout_ref.model.path=some-org/not-here-70B",
        ],
        Assumptions(),
        out=sys.stdout,
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(lines) == 1
    assert lines[0].startswith("plan: skipped: some-org/not-here-70B") and "--world-size 32" in lines[0]


def test_fsdp1_start_up_line_sizes_the_device_copy(tmp_path):
    from slimckpt.verl.dryrun import compose_config
    from slimckpt.verl.fsdp1_note import fsdp1_cost_line

    model = tmp_path / "llama3-70b"
    model.mkdir()
    (model / "config.json").write_text((REPO / "docs" / "configs" / "llama3-70b.json").read_text())
    base = ["+size=70b", "+cluster=4x8", "+algo=ppo", "+recipe=incremental", f"actor_rollout_ref.model.path={model}"]
    assert (
        fsdp1_cost_line(
            compose_config(base + ["actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2"]), use_critic=True
        )
        == ""
    )
    line = fsdp1_cost_line(compose_config(base), use_critic=True)  # verl's default strategy: fsdp
    assert "\n" not in line and "every actor and critic save" in line
    # 12 bytes x 70.55e9 parameters / 32 GPUs
    assert "24.64 GiB per GPU at 70.6B parameters over 32 GPUs" in line and "strategy=fsdp2" in line
    quick = [o if o != "+recipe=incremental" else "+recipe=quickstart" for o in base]
    assert fsdp1_cost_line(compose_config(quick), use_critic=True) == ""


@pytest.mark.slow
def test_fsdp1_dry_run_checks_the_gpu_peak_and_refuses_in_one_line():
    """`train_70b.sh --dry-run` on FSDP1 with SLIMCKPT_GPU_MEMORY_GB: a run whose save does not fit the GPU
    stops (exit 2) in one line naming strategy=fsdp2 and the override; one that fits says by how much."""
    env = {**os.environ, "PYTHON": sys.executable, "NODE_MEMORY_GB": "2048", "SLIMCKPT_GPU_MEMORY_GB": "80"}
    for knob in ("NNODES", "GPUS_PER_NODE", "MODEL_PATH", "ALGO"):
        env.pop(knob, None)
    fsdp1 = ["+recipe=incremental", "actor_rollout_ref.actor.strategy=fsdp", "critic.strategy=fsdp"]
    actor_on_gpu = [f"actor_rollout_ref.actor.fsdp_config.{k}_offload=false" for k in ("param", "optimizer")]
    critic_on_gpu = [f"critic.fsdp.{k}_offload=false" for k in ("param", "optimizer")]

    def dry(*args: str) -> subprocess.CompletedProcess:
        # one interpreter imports verl, composes and plans: seconds; 600 s is a hang
        return subprocess.run(
            ["bash", str(TRAIN_70B), "--dry-run", "--no-print", *args],
            env=env,
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=600,
        )

    refused = dry(*fsdp1, *actor_on_gpu, *critic_on_gpu)
    stops = [line for line in refused.stderr.splitlines() if line.startswith("slimckpt: an incremental save on FSDP1")]
    assert refused.returncode == 2 and len(stops) == 1, refused.stderr[-3000:]
    assert "of 80.0 GiB (SLIMCKPT_GPU_MEMORY_GB=80)" in stops[0] and "strategy=fsdp2" in stops[0]
    assert "critic.checkpoint.allow_fsdp1_device_copy=true" in stops[0]
    # the critic offloaded (the 70B override's default): 6 GiB to spare, and where its AdamW copy goes
    fits = dry(*fsdp1, *actor_on_gpu)
    line = next(x for x in fits.stderr.splitlines() if "at the actor's save a GPU holds" in x)
    assert fits.returncode == 0 and ": fits, 6.2 GiB to spare" in line, line
    assert "the critic's AdamW rows are copied in host memory instead" in line
    # anyway: the override starts the refused run, saying it does not fit
    anyway = dry(
        *fsdp1,
        *actor_on_gpu,
        *critic_on_gpu,
        "actor_rollout_ref.actor.checkpoint.allow_fsdp1_device_copy=true",
        "critic.checkpoint.allow_fsdp1_device_copy=true",
    )
    assert anyway.returncode == 0 and "does NOT fit, started anyway" in anyway.stderr, anyway.stderr[-2000:]
