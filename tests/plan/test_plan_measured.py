"""`slimckpt plan` held to the saves `make bench` and `make bench-train-scale` measured (docs/bench_save.json,
docs/bench_train_scale.json): bytes and rank 0's host memory of every committed point agree, and docs/plan_check.md shows what the plan predicts now."""

from __future__ import annotations

import json
import sys

import pytest

from scripts.bench import plan_check
from slimckpt.plan import cli, cost

from ..conftest import REPO


@pytest.fixture(scope="module")
def check():
    return plan_check


@pytest.fixture(scope="module")
def parts(check):
    """docs/bench_save.json, its planned points, and those of docs/bench_train_scale.json."""
    bench = json.loads((REPO / "docs" / "bench_save.json").read_text())
    train = json.loads((REPO / "docs" / "bench_train_scale.json").read_text())
    return bench, check.points(bench, world=2), check.train_points(train, world=2)


@pytest.fixture(scope="module")
def found(parts):
    bench, ours, train = parts
    return bench, ours + train


def test_every_measured_save_agrees_with_the_plan(found):
    bench, points = found
    assert len(points) >= len(bench["rows"]) + 3  # three sizes, verl's save and ours; 3.6B: our three tiers
    assert {p.mode for p in points if p.params > 3e9} == {"intermediate", "incremental", "stream"}
    for p in points:
        assert p.bytes_ok, (p.size, p.mode, p.planned_bytes, p.measured_bytes)
        assert p.host_ok, (p.size, p.mode, p.planned_host, p.measured_host)


def test_verl_hf_model_is_planned_as_the_whole_model_on_rank_0(found):
    """The point of the plan: verl's hf_model save grows with the model on rank 0, ours does not."""
    _, points = found
    verl = sorted((p for p in points if p.mode == "verl"), key=lambda p: p.params)
    ours = [p for p in points if p.mode == "incremental"]
    assert verl[-1].planned_host > 3.5 * verl[0].planned_host and verl[-1].planned_host > 4 * 2**30 * 0.9
    assert all(p.planned_host <= 64 * 2**20 and p.measured_host <= 64 * 2**20 for p in ours)


def test_the_committed_table_is_what_the_plan_says_now(check, found):
    bench, points = found
    committed = (REPO / "docs" / "plan_check.md").read_text()
    assert check.table(points, bench["meta"]) in committed, (
        "run: python -m scripts.bench.plan_check --out docs/plan_check.md"
    )


def test_readme_shows_the_plan_next_to_the_largest_measured_saves(check, parts):
    _, ours, train = parts
    rows = check.headline(ours, train)
    assert rows in (REPO / "README.md").read_text(), "run: python -m scripts.bench.plan_check --out docs/plan_check.md"
    assert rows.count("\n| ") == 3 and "3.61B" in rows and "verl 0.9.1" in rows


def test_cpu_and_accelerator_differ_only_where_a_copy_to_host_is_made():
    params = [cost.ParamSpec("embed", (1000, 64)), cost.ParamSpec("w", (64, 64))]
    largest = cost.largest_shard_bytes(params, 2, 0)
    staged = cost.model_shard_bytes(params, 2, 0) + cost.optim_shard_bytes(params, 2, 0)
    inc = cost.Strategy("inc", incremental=True, export_hf=True, export_dtype="auto")
    est = lambda s, device, fsdp=2: cost.estimate(params, 2, s, 0, 0, None, fsdp=fsdp, device=device)  # noqa: E731
    assert est(inc, "accelerator").host_peak_bytes == min(staged, 64 * 2**20 + largest)
    assert est(inc, "cpu").host_peak_bytes == 0  # DCP writes the host tensors as they are
    assert est(inc, "cpu", fsdp=1).host_peak_bytes == staged  # FSDP1's reshardable copy is host memory there
    cast = cost.Strategy("inc", incremental=True, export_hf=True, export_dtype="bf16", bucket_mb=8, write_threads=2)
    assert est(cast, "cpu").host_peak_bytes == 2 * 8 * 2**20
    pool = cost.Strategy("inc", incremental=True, async_save=True, host_memory_budget_gb=1)
    assert est(pool, "cpu").host_peak_bytes == est(pool, "accelerator").host_peak_bytes == staged
    assert est(cost.Strategy("verl"), "cpu").host_peak_bytes == 0
    assert (
        est(cost.Strategy("verl"), "cpu", fsdp=1).host_peak_bytes == 0
    )  # offload_to_cpu of a host tensor copies nothing
    hf = cost.Strategy("verl", contents=(*cost.VERL_CONTENTS, "hf_model"))
    full = sum(p.nbytes for p in params)
    assert est(hf, "cpu").host_peak_bytes == est(hf, "accelerator").host_peak_bytes == largest + full


def test_plan_prints_no_warning_naming_its_temp_dir(tmp_path):
    import subprocess

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 256,
            }
        )
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimckpt.cli",
            "plan",
            "--config",
            str(tmp_path / "config.json"),
            "--world-size",
            "2",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        # the plan's imports can wait minutes on a busy disk; 900 s still catches a hang
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "slimckpt-plan-" not in proc.stderr + proc.stdout and "WARNING" not in proc.stderr, proc.stderr
    assert "CPU: torch.save pickles the host tensors in place" in proc.stdout


def test_hf_listing_follows_the_exporting_recipe(tmp_path, capsys):
    """`--recipe incremental` lists the export it writes (its export_dtype, in its max_shard_size files);
    export_dtype=auto lists fp32; an explicit --export-dtype still wins."""
    import yaml

    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    recipe = yaml.safe_load((REPO / "recipes" / "incremental.yaml").read_text())["actor_rollout_ref"]["actor"][
        "checkpoint"
    ]
    shard = recipe.get("max_shard_size", SlimCheckpointConfig.__dataclass_fields__["max_shard_size"].default)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 256,
            }
        )
    )
    base = ["--config", str(tmp_path / "config.json"), "--world-size", "2", "--json"]

    def report(*more: str) -> dict:
        assert cli.main([*base, *more]) == 0
        return json.loads(capsys.readouterr().out)

    ours = report("--recipe", "incremental")
    assert ours["hf_export"]["dtype"] == recipe["export_dtype"] == "bf16"  # the recipe's bounded default
    assert str(ours["hf_export"]["max_shard_size"]) == str(shard)
    inc = next(e for e in ours["estimates"] if e["strategy"] == "+recipe=incremental")
    assert inc["hf_export_bytes"] == ours["hf_export"]["bytes"]  # the listing is the export that row writes
    auto = report("--recipe", "incremental", "--set", "export_dtype=auto")  # the parameters' dtype: fp32
    assert auto["hf_export"]["dtype"] == "fp32" and auto["hf_export"]["bytes"] > ours["hf_export"]["bytes"]
    asked = report("--recipe", "incremental", "--set", "export_dtype=auto", "--export-dtype", "bf16")
    assert asked["hf_export"]["dtype"] == "bf16" and asked["hf_export"]["bytes"] == ours["hf_export"]["bytes"]
