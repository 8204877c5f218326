"""Measuring observes and changes nothing: SLIMCKPT_MEASURE=1 on plain verl wraps verl's
save in a timer and an RSS sampler, and every other checkpoint path (retention, tracker, load)
stays verl's own; reports go outside the checkpoint; async saves report their write at the commit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from slimckpt.observe import save_reports
from slimckpt.verl.ckpt_metrics import CheckpointMetricsCallback

from ..conftest import REPO, run_python


def test_measured_plain_verl_runs_verls_own_checkpoint_code():
    """Every attribute the "checkpoint" feature would replace is verl's; only save_checkpoint is
    wrapped, and by the measure patch, around verl's own function."""
    res = run_python(
        textwrap.dedent("""
        import inspect, verl
        import verl.trainer.ppo.v1.trainer_base as v1, verl.trainer.ppo.ray_trainer as legacy
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager as M
        from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager as B
        from slimckpt.verl.registry import REGISTRY
        def where(f):
            return inspect.unwrap(f).__code__.co_filename.split("site-packages/")[-1], f.__code__.co_filename.rsplit("/", 1)[-1]
        for name, f in [("load", M.load_checkpoint), ("ensure_capacity", B.ensure_checkpoint_capacity),
                        ("register", B.register_checkpoint), ("v1_save", v1.PPOTrainer._save_checkpoint),
                        ("legacy_save", legacy.RayPPOTrainer._save_checkpoint),
                        ("v1_find", v1.find_latest_ckpt_path), ("legacy_find", legacy.find_latest_ckpt_path)]:
            print("OWN", name, f.__code__.co_filename.rsplit("/", 1)[-1])
        print("SAVE", *where(M.save_checkpoint))
        print("APPLIED", sorted(REGISTRY.applied()))
    """),
        env={"SLIMCKPT_MEASURE": "1", "SLIMCKPT_CHECKPOINT": "", "SLIMCKPT_CPU": ""},
    )
    assert res.returncode == 0, res.stderr
    own = dict(line.split()[1:] for line in res.stdout.splitlines() if line.startswith("OWN"))
    assert own == {
        "load": "fsdp_checkpoint_manager.py",
        "ensure_capacity": "checkpoint_manager.py",
        "register": "checkpoint_manager.py",
        "v1_save": "trainer_base.py",
        "legacy_save": "ray_trainer.py",
        "v1_find": "checkpoint_manager.py",
        "legacy_find": "checkpoint_manager.py",
    }, res.stdout
    assert "SAVE verl/utils/checkpoint/fsdp_checkpoint_manager.py checkpoint_patches.py" in res.stdout
    # adopt.startup (which step a relaunch resumes, checked in the driver's validate_config) is on
    # whenever slimckpt is: it changes no checkpoint code
    assert "APPLIED ['adopt.startup', 'measure.save']" in res.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _save(out: str, measure: bool) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "SLIMCKPT_MEASURE": "1" if measure else "",
        "SLIMCKPT_CHECKPOINT": "",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "slimckpt_testing.verl_checkpoints.fsdp_checkpoint", "--out", out, "--steps", "1"],
        env=env,
        capture_output=True,
        text=True,
        # one rank starts torch and saves a tiny model for one step: seconds; 300 s is a hang
        timeout=300,
        cwd=REPO,
    )


def _listing(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_a_measured_verl_save_writes_verls_files_and_reports_beside_them(tmp_path):
    plain, measured = tmp_path / "plain", tmp_path / "measured"
    for root, measure in ((plain, False), (measured, True)):
        res = _save(str(root / "global_step_1" / "actor"), measure)
        assert res.returncode == 0, res.stderr[-3000:]
    assert _listing(str(measured / "global_step_1")) == _listing(str(plain / "global_step_1"))
    assert not (plain / save_reports.REPORTS_DIR).exists()
    report = json.loads(
        (measured / save_reports.REPORTS_DIR / "global_step_1" / "actor" / "rank_0.save.json").read_text()
    )
    assert report["recipe"] == "verl-default" and report["committed"] and not report["async"]
    assert report["bytes_written"] > 0 and report["seconds"] == report["blocking_seconds"] > 0


def test_reports_live_outside_the_step_and_are_pruned_with_it(tmp_path):
    actor = tmp_path / "global_step_3" / "actor"
    actor.mkdir(parents=True)
    path = save_reports.write_report({"global_step": 3, "time": 1.0}, str(actor), 1, "save")
    assert path == str(tmp_path / "slimckpt_reports" / "global_step_3" / "actor" / "rank_1.save.json")
    assert save_reports.read_reports(str(actor.parent), 3)[0]["kind"] == "save"
    assert save_reports.prune(str(tmp_path)) == []  # its role dir exists
    actor.rmdir()  # retention
    assert save_reports.prune(str(tmp_path)) == [str(tmp_path / "slimckpt_reports" / "global_step_3" / "actor")]
    assert not (tmp_path / "slimckpt_reports" / "global_step_3").exists()
    with pytest.raises(ValueError):
        save_reports.report_path(str(actor), 0, "other")


def _report(step: int, role: str, rank: int, **extra) -> dict:
    return {"global_step": step, "rank": rank, "role": role, "time": time.time(), **extra}


def test_async_save_logs_blocking_now_and_its_write_when_committed(tmp_path):
    logged = []
    trainer = SimpleNamespace(logger=SimpleNamespace(log=lambda data, step: logged.append((step, data))))
    callback = CheckpointMetricsCallback(config=None)
    step = {s: tmp_path / f"global_step_{s}" for s in (1, 2)}
    for s in (1, 2):
        (step[s] / "actor").mkdir(parents=True)
    blocking = dict(
        committed=False,
        blocking_seconds=0.25,
        seconds=None,
        bytes_written=None,
        peak_rss_anon_bytes=3 * 10**9,
        peak_rss_extra_bytes=10**9,
    )
    for r in (0, 1):
        save_reports.write_report(_report(1, "actor", r, **blocking), str(step[1] / "actor"), r, "save")
    callback.on_save(trainer=trainer, global_step=1, checkpoint_dir=str(step[1]), async_save=False)
    assert logged == [(1, {"ckpt/blocking_seconds": 0.25, "ckpt/ranks": 2.0})]  # nothing written yet: no bytes

    for r in (0, 1):  # step 1's write commits in the background, then step 2 saves
        save_reports.write_report(
            _report(
                1,
                "actor",
                r,
                committed=True,
                blocking_seconds=0.25,
                write_seconds=2.0 + r,
                seconds=2.25 + r,
                bytes_written=10**9,
                peak_rss_anon_bytes=4 * 10**9,
                peak_rss_extra_bytes=2 * 10**9,
                staging_pool_bytes=5 * 10**8,
            ),
            str(step[1] / "actor"),
            r,
            "commit",
        )
        save_reports.write_report(_report(2, "actor", r, **blocking), str(step[2] / "actor"), r, "save")
    callback.on_save(trainer=trainer, global_step=2, checkpoint_dir=str(step[2]))
    at, metrics = logged[-1]
    assert at == 2 and metrics["ckpt/blocking_seconds"] == 0.25
    assert metrics["ckpt/committed_step"] == 1.0
    assert metrics["ckpt/write_seconds"] == pytest.approx(3.0) and metrics["ckpt/seconds"] == pytest.approx(3.25)
    assert metrics["ckpt/bytes_gb"] == pytest.approx(2.0) and metrics["ckpt/peak_rss_extra_gb"] == pytest.approx(2.0)
    assert metrics["ckpt/staging_pool_gb"] == pytest.approx(0.5)
    callback.on_save(trainer=trainer, global_step=2, checkpoint_dir=str(step[2]))
    assert "ckpt/committed_step" not in logged[-1][1]  # a commit is logged once
