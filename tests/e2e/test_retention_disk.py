"""Retention that fits a large model's disk: keep_optimizer_last (only the newest steps keep their
optimizer state) and keep_best (the best steps by a logged metric, recorded under the root
save/driver/driver_state keeps on verl's logger), never the tracker's step or a step a reader holds;
`slimckpt plan`'s numbers for it; a dropped step resumes model-only and passes `slimckpt verify`. The slow tests run verl's real FSDPCheckpointManager under torchrun
(slimckpt_testing/scenarios/retention.py), in both formats our recipes write."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import slimckpt.layout.retention_plan as rp
from slimckpt.plan import cost
from slimckpt.save.retention import best_metric
from slimckpt_testing.launch import launch
from tests.helpers.launch import REPO


def _paths(steps) -> list[str]:
    return [f"/run/global_step_{s}/actor" for s in steps]


# --------------------------------------------------------------------------- the decision (pure)


def test_the_newest_the_best_and_the_trackers_step_stay():
    paths = _paths(range(1, 7))
    metrics = {p: v for p, v in zip(paths, [0.9, 0.1, 0.8, 0.2, 0.3, None])}
    policy = rp.RetentionPolicy(max_keep=2, keep_best=2, best_metric="m")
    d = rp.plan(paths, policy, protect={paths[1]}, metrics=metrics)
    assert d.keep == [paths[0], paths[1], paths[2], paths[4], paths[5]]
    assert d.best == [paths[0], paths[2]] and d.protected == [paths[1]]
    assert d.delete == [paths[3]] and d.drop_optimizer == []


def test_only_the_newest_and_the_trackers_step_keep_their_optimizer():
    paths = _paths(range(1, 6))
    d = rp.plan(paths, rp.RetentionPolicy(max_keep=4, optimizer_last=1), protect={paths[3]})
    assert d.delete == [paths[0]]
    assert d.drop_optimizer == [paths[1], paths[2]]  # step 4 is the tracker's, step 5 the newest


def test_best_ranks_finite_values_newest_first_on_ties_and_min_mode():
    paths = _paths(range(1, 6))
    metrics = {paths[0]: 1.0, paths[1]: float("nan"), paths[2]: 1.0, paths[3]: "text", paths[4]: 0.5}
    assert rp.best_paths(paths, metrics, 1, "max") == [paths[2]]
    assert rp.best_paths(paths, metrics, 2, "min") == [paths[4], paths[2]]
    assert rp.best_paths(paths, metrics, 0, "max") == []


def _simulate(policy: rp.RetentionPolicy, saves: int = 12) -> dict[str, int]:
    """slimckpt's order over `saves` saves (tracker moved after each), the oldest steps the best:
    before a save the optimizer drops of retention.optimizer_drops, at its commit retention.apply's
    plan. Returns the steps held while the last one is written."""
    tracked: list[str] = []
    has_optimizer: dict[str, bool] = {}
    metrics: dict[str, float] = {}
    tracker = None
    peak = {}
    for step in range(1, saves + 1):
        protect = {tracker} if tracker else set()
        if policy.optimizer_last is not None and tracked:
            d = rp.plan(tracked, policy, protect, metrics)
            spared = set(d.keep) - set(d.drop_optimizer)
            for p in tracked:
                if p not in spared:
                    has_optimizer[p] = False
        whole = sum(1 for p in tracked if has_optimizer[p]) + 1
        peak = {"whole": whole, "without_optimizer": len(tracked) + 1 - whole}
        new = f"/run/global_step_{step}/actor"
        tracked.append(new)
        has_optimizer[new] = True
        d = rp.plan(tracked, policy, protect, metrics)
        for p in d.drop_optimizer:
            has_optimizer[p] = False
        tracked = [p for p in tracked if p not in d.delete]
        metrics[new] = 1.0 / step  # logged after the save: the oldest steps rank best
        tracker = new
    return peak


@pytest.mark.parametrize("max_keep", [1, 2, 3, 4])
@pytest.mark.parametrize("optimizer_last", [None, 1, 2, 3])
@pytest.mark.parametrize("keep_best", [0, 1, 2])
def test_steps_held_is_what_retention_leaves_on_disk(max_keep, optimizer_last, keep_best):
    """plan's arithmetic (steps_held over retention.peak_steps) against the policy carried out."""
    from slimckpt.save.retention.prune import peak_steps

    policy = rp.RetentionPolicy(
        max_keep=max_keep, optimizer_last=optimizer_last, keep_best=keep_best, best_metric="m" if keep_best else None
    )
    held = rp.steps_held(policy, peak_steps(max_keep))
    seen = _simulate(policy)
    assert held["whole"] == seen["whole"], (held, seen)
    assert held["without_optimizer"] == seen["without_optimizer"], (held, seen)


def test_plan_prices_each_choice(tmp_path):
    """`slimckpt plan` rows: a whole step costs step bytes, one without its optimizer those less."""
    out = cost.retention_disk(10_000, 6_000, 3, 1, keep_best=2)
    held = out["steps"]
    assert out["bytes"]["usual"] == held["whole"] * 10_000 + held["without_optimizer"] * 4_000
    every = cost.retention_disk(10_000, 6_000, 3, None, keep_best=2)
    assert every["bytes"]["usual"] > out["bytes"]["usual"]
    assert cost.retention_disk(10_000, 6_000, None, 1)["bytes_per_save"] == 4_000


def test_plan_prints_the_retention_table(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(
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
                "tie_word_embeddings": False,
            }
        )
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimckpt.plan",
            "--config",
            str(cfg),
            "--world-size",
            "4",
            "--recipe",
            "incremental",
            "--max-actor-ckpt-to-keep",
            "3",
            "--set",
            "keep_optimizer_last=1",
            "--set",
            "keep_best=1",
            "--set",
            "best_metric=critic/score/mean",
        ],
        capture_output=True,
        text=True,
        # the plan reads a config and prints a table (no torchrun): seconds; 120 s is a hang
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    table = res.stdout[res.stdout.index("retention with keep_optimizer_last") : res.stdout.index("resume and leave")]
    rows = [line for line in table.splitlines() if line.startswith("+recipe=incremental")]
    assert [("newest 1" in r, "all kept" in r) for r in rows] == [(True, False), (False, True)], table
    assert "verl default" not in table  # verl's own retention has no such keys


def test_the_config_refuses_settings_retention_cannot_carry_out():
    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    for kwargs, key in (
        ({"keep_optimizer_last": 0}, "keep_optimizer_last"),
        ({"keep_best": 2}, "best_metric"),
        ({"best_mode": "avg"}, "best_mode"),
        ({"keep_optimizer_last": "two"}, "keep_optimizer_last"),
    ):
        with pytest.raises(ValueError, match=key):
            SlimCheckpointConfig(**kwargs)
    ok = SlimCheckpointConfig(keep_optimizer_last="null", keep_best="2", best_metric="critic/score/mean")
    assert ok.keep_optimizer_last is None and ok.keep_best == 2


def test_the_trainers_tracking_records_metrics_at_save_steps_only(tmp_path):
    """verl's Tracking (what both trainers log through), built with a config asking for keep_best:
    each log call at a step whose dir exists adds its numbers to that step's metrics file."""
    from verl.utils.tracking import Tracking

    from slimckpt.verl.checkpoint_config import SlimCheckpointConfig

    SlimCheckpointConfig()  # a recipe's config switches the checkpoint patches on, as in verl's trainer
    (tmp_path / "global_step_2").mkdir()
    target = "slimckpt.verl.checkpoint_config.SlimCheckpointConfig"
    config = {
        "trainer": {"default_local_dir": str(tmp_path)},
        "actor_rollout_ref": {
            "actor": {"checkpoint": {"_target_": target, "keep_best": 1, "best_metric": "val/score"}}
        },
    }
    tracking = Tracking(project_name="p", experiment_name="e", default_backend="console", config=config)
    tracking.log(data={"val/score": 0.5, "note": "x"}, step=1)  # no save at step 1
    tracking.log(data={"val/score": 0.75}, step=2)
    tracking.log(data={"critic/score/mean": 1.5}, step=2)
    assert not (tmp_path / "global_step_1").exists()
    assert best_metric.step_metric(str(tmp_path / "global_step_2"), "val/score") == 0.75
    assert best_metric.step_metric(str(tmp_path / "global_step_2"), "critic/score/mean") == 1.5
    plain = dict(config, actor_rollout_ref={"actor": {"checkpoint": {"_target_": target}}})
    (tmp_path / "global_step_3").mkdir()
    Tracking(project_name="p", experiment_name="e", default_backend="console", config=plain).log({"a": 1}, step=3)
    assert not (tmp_path / "global_step_3" / best_metric.METRICS_NAME).exists()  # only with keep_best


# --------------------------------------------------------------------------- through verl's manager (slow)


def _scenario(tmp_path: Path, fmt: str) -> dict:
    run = launch(
        2,
        "slimckpt_testing.scenarios.retention",
        "--dir",
        str(tmp_path),
        "--format",
        fmt,
        # 2 ranks through verl's manager: ~40 s on a loaded host; 300 s is a hang
        timeout=300,
        cwd=REPO,
        env={"OMP_NUM_THREADS": "1", "SLIMCKPT_LOG_LEVEL": "INFO"},
        result=tmp_path / f"retention_{fmt}_result.json",
    )
    assert run.proc.returncode == 0, run.output
    assert run.result is not None, run.output
    return run.result


def _verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(  # verify reads a tiny checkpoint after its imports: seconds; 180 s is a hang
        [sys.executable, "-m", "slimckpt.cli", "verify", str(path)], capture_output=True, text=True, timeout=180
    )


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["incremental", "verl"])
def test_retention_keeps_what_it_says_across_saves(tmp_path, fmt):
    """Five saves at max_actor_ckpt_to_keep=2, keep_optimizer_last=1, keep_best=1 (step 1 scores
    best), a reader holding step 2 during the fourth save. {step on disk: holds optimizer state}
    after each save, as the policy says: the newest and the tracker's step keep the optimizer, the
    best step stays without it, the locked step outlives its save, the tracker's step is never deleted."""
    r = _scenario(tmp_path, fmt)
    expected = {
        "1": {"global_step_1": True},
        "2": {"global_step_1": True, "global_step_2": True},  # step 1 is the tracker's at step 2's commit
        "3": {"global_step_1": False, "global_step_2": True, "global_step_3": True},
        # step 2 fell out of the newest two, but a reader held it: kept whole, retried
        "4": {"global_step_1": False, "global_step_2": True, "global_step_3": True, "global_step_4": True},
        "5": {"global_step_1": False, "global_step_4": True, "global_step_5": True},
    }
    assert r["after_save"] == expected, r["after_save"]
    assert any("a reader or writer holds its lock" in line and "global_step_2" in line for line in r["retention_lines"])
    assert r["bytes"]["global_step_1"] < min(r["bytes"]["global_step_4"], r["bytes"]["global_step_5"])

    # resume after pruning: the dropped step loads its model exactly, a fresh optimizer, one line
    assert r["model_equal_diffs"] == [] and r["adam_moments_after_model_only"] == 0.0
    assert len(r["dropped_lines"]) == 1 and "has no optimizer state, retention dropped it" in r["dropped_lines"][0]
    assert r["model5_diffs"] == [] and r["adam_moments_after_whole"] > 0.0  # the newest: exact

    root = tmp_path / fmt
    res = _verify(root / "global_step_1" / "actor")  # the step without its optimizer
    assert res.returncode == 0 and "OK:" in res.stdout + res.stderr, res.stdout + res.stderr
    if fmt == "incremental":
        _interrupted_drops(root / "global_step_4" / "actor", tmp_path)


def _interrupted_drops(whole: Path, tmp_path: Path) -> None:
    """A kill at each point of an incremental step's drop: before its new manifest (rolled back),
    after it (rolled forward); the step is intact at both points and after the next pass."""
    from slimckpt.layout.resume_manifest import role_damage
    from slimckpt.save.retention import optimizer_drop

    for stop_after_manifest in (False, True):
        role = tmp_path / f"kill_{stop_after_manifest}" / "global_step_4" / "actor"
        shutil.copytree(whole, role)
        real = optimizer_drop.finish_interrupted
        real_write = optimizer_drop.write_manifest

        class Killed(Exception):
            pass

        def killed_write(*args):
            if stop_after_manifest:
                real_write(*args)
            raise Killed

        optimizer_drop.write_manifest = killed_write
        try:
            with pytest.raises(Killed):
                optimizer_drop.drop_optimizer(str(role), 1)
        finally:
            optimizer_drop.write_manifest = real_write
        assert (role / optimizer_drop.NEW_DIR).is_dir()
        assert role_damage(str(role))[1] == []  # the old step, still committed (what verify and a load check)
        real(str(role))
        assert optimizer_drop.holds_optimizer(str(role)) is not stop_after_manifest
        assert not (role / optimizer_drop.NEW_DIR).exists() and role_damage(str(role))[1] == []


# --------------------------------------------------------------------------- verl's real trainer (slow)


def _replay(root: Path, steps: int, policy: rp.RetentionPolicy) -> dict[str, bool]:
    """The policy carried out over the run's saves with the metrics the trainer recorded:
    {global_step_N: holds optimizer state} of what must be on disk at the end."""
    tracked: list[str] = []
    has_optimizer: dict[str, bool] = {}
    metrics: dict[str, float | None] = {}
    tracker = None
    for step in range(1, steps + 1):
        protect = {tracker} if tracker else set()
        if tracked:
            d = rp.plan(tracked, policy, protect, metrics)
            spared = set(d.keep) - set(d.drop_optimizer)
            has_optimizer.update({p: False for p in tracked if p not in spared})
        new = str(root / f"global_step_{step}" / "actor")
        tracked.append(new)
        has_optimizer[new] = True
        d = rp.plan(tracked, policy, protect, metrics)
        has_optimizer.update({p: False for p in d.drop_optimizer})
        tracked = [p for p in tracked if p not in d.delete]
        metrics[new] = best_metric.step_metric(os.path.dirname(new), policy.best_metric)
        tracker = new
    return {Path(p).parent.name: has_optimizer[p] for p in tracked}


@pytest.mark.slow
@pytest.mark.trainer
def test_the_trainer_keeps_what_the_policy_says_and_resumes_a_dropped_step(retention_runs):
    """GRPO, 2 ranks, +recipe=incremental, 4 saves at max_actor_ckpt_to_keep=2 with
    keep_optimizer_last=1 and keep_best=3 by critic/score/mean: every save step's metrics are
    recorded by verl's own Tracking, the steps on disk (and which hold the optimizer) are the policy's
    over those metrics, each is intact (`slimckpt verify`); a relaunch from step 1 (its optimizer dropped)
    resumes its model in one line and trains on."""
    from slimckpt.save.retention.optimizer_drop import holds_optimizer

    run, resumed = retention_runs
    recorded = {
        s: best_metric.step_metric(str(run.ckpt / f"global_step_{s}"), "critic/score/mean") for s in range(1, 5)
    }
    assert all(v is not None for v in recorded.values()), recorded
    expected = _replay(
        run.ckpt, 4, rp.RetentionPolicy(max_keep=2, optimizer_last=1, keep_best=3, best_metric="critic/score/mean")
    )
    on_disk = {
        p.name: holds_optimizer(str(p / "actor"))
        for p in sorted(run.ckpt.glob("global_step_*"))
        if (p / "actor").is_dir()
    }
    assert on_disk == expected, (on_disk, expected, recorded)
    assert expected["global_step_1"] is False and expected["global_step_4"] is True
    from slimckpt.layout.resume_manifest import role_damage

    for name in on_disk:  # the one definition of intact a load, `slimckpt verify` and the walk back ask
        assert role_damage(str(run.ckpt / name / "actor"))[1] == [], name
    res = _verify(run.ckpt / "global_step_1" / "actor")  # and the command itself on the dropped step
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [line for line in resumed.text.splitlines() if "has no optimizer state, retention dropped it" in line]
    assert len(lines) == 1 and "global_step_1/actor" in lines[0], resumed.text[-3000:]
    assert "step:2 -" in resumed.text  # trained on from step 1
