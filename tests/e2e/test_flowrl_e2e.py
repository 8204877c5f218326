"""FlowRL in verl 0.9.1's own trainer on CPU (scripts/train_small.sh algo=flowrl, 2 ranks, 2 steps):
it trains the actor and its log Z head, saves both in the actor's checkpoint, logs ckpt/* save
metrics to wandb (offline) at the save steps, and leaves the head out of verl's hf_model save and
of the merged Hugging Face model (`python -m verl.model_merger merge`, redirected to slimckpt's
streaming merge). One training run shared by the tests below: tests/helpers/verl_runs.py's `flowrl`, started in
the background when the session starts."""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimckpt.observe.save_reports import REPORTS_DIR
from slimckpt.observe.wandb_history import load
from slimckpt_flowrl import is_flowrl_param

from ..conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.trainer]


def _safetensors_keys(folder: Path) -> list[str]:
    from safetensors import safe_open

    keys = []
    for path in sorted(glob.glob(str(folder / "*.safetensors"))):
        with safe_open(path, "pt") as f:
            keys += list(f.keys())
    return keys


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def test_flowrl_trains_with_its_own_loss(flowrl_run):
    text = flowrl_run.text
    assert "registered policy loss 'flowrl'" in text
    lines = [line for line in text.splitlines() if " - actor/flowrl_log_z:" in line]
    assert len(lines) == 2  # one per step, from the registered loss's metrics
    assert "step:2 - " in lines[-1]


def test_head_is_in_the_actor_checkpoint_and_trained(flowrl_run):
    ckpt = flowrl_run.ckpt
    shards = {}
    for step in (1, 2):
        state = torch.load(
            ckpt / f"global_step_{step}" / "actor" / "model_world_size_2_rank_0.pt", weights_only=False, mmap=True
        )
        shards[step] = {k: _local(v) for k, v in state.items() if is_flowrl_param(k)}
    assert sorted(shards[1]) == [
        "flowrl_log_z.net.0.bias",
        "flowrl_log_z.net.0.weight",
        "flowrl_log_z.net.2.bias",
        "flowrl_log_z.net.2.weight",
    ]
    assert not torch.equal(shards[1]["flowrl_log_z.net.0.weight"], shards[2]["flowrl_log_z.net.0.weight"])


def test_hf_exports_leave_the_head_out(flowrl_run, tmp_path):
    ckpt = flowrl_run.ckpt
    actor = ckpt / "global_step_2" / "actor"
    # verl's own hf_model save (gathered on rank 0 inside the training run)
    saved = _safetensors_keys(actor / "huggingface")
    assert saved and not [k for k in saved if is_flowrl_param(k)]
    # verl's merger command, which slimckpt redirects to its streaming merge
    target = tmp_path / "merged"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl.model_merger",
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            str(actor),
            "--target_dir",
            str(target),
        ],
        capture_output=True,
        text=True,
        # the redirected merger imports verl and merges a tiny checkpoint: seconds; 300 s is a hang
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = _safetensors_keys(target)
    assert sorted(merged) == sorted(saved)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target)  # loads with no unexpected or missing keys
    assert not hasattr(model, "flowrl_log_z")


def test_save_metrics_logged_to_wandb_and_readable_by_compare_runs(flowrl_run, tmp_path):
    ckpt = flowrl_run.ckpt
    for step in (1, 2):
        reports = sorted((ckpt / REPORTS_DIR / f"global_step_{step}" / "actor").glob("rank_*.save.json"))
        assert not list((ckpt / f"global_step_{step}" / "actor").glob("slimckpt_save_rank_*"))  # none in the checkpoint
        assert len(reports) == 2 and json.loads(reports[0].read_text())["global_step"] == step
    out, table = tmp_path / "cmp.png", tmp_path / "cmp.md"
    wandb_runs = flowrl_run.wandb / "wandb"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.compare.runs",
            f"flowrl={wandb_runs}",
            "--out",
            str(out),
            "--table",
            str(table),
        ],
        capture_output=True,
        text=True,
        # reads one offline run and draws one plot: seconds; 120 s is a hang
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in table.read_text().splitlines() if line.startswith("| `flowrl`"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == "2" and cells[4] == "2"  # 2 steps, ckpt/* logged at both saves
    assert out.stat().st_size > 10_000


def test_wandb_offline_run_has_grouped_keys_and_wandb_sync_takes_it(flowrl_run):
    """wandb's UI makes a section of panels per key prefix: the save's, the reward's and validation's."""
    history = load(f"flowrl={flowrl_run.wandb / 'wandb'}")
    prefixes = {key.split("/", 1)[0] for key in history.keys()}
    assert {"ckpt", "critic", "actor", "val-core"} <= prefixes
    assert [s for s, _ in history.series("ckpt/seconds")] == [1, 2]
    assert [s for s, _ in history.series("val-core/slimckpt/tiny_add/acc/mean@1")] == [2]
    (run_dir,) = history.sources
    wandb_cli = Path(sys.executable).with_name("wandb")
    proc = subprocess.run(
        [str(wandb_cli), "sync", "--dry-run", run_dir],
        capture_output=True,
        text=True,
        # wandb sync --dry-run reads one small offline run: seconds; 120 s is a hang
        timeout=120,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    assert proc.returncode == 0 and "Would sync 1 run" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
