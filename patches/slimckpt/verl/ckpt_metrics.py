"""`ckpt/*` metrics in verl's tracker (wandb, console, ...), at the step of each save.

Each measured save reports per rank (slimckpt.observe.save_measure, outside the checkpoint:
`<root>/slimckpt_reports/global_step_N/<role>/`). verl 0.9.1's v1 trainer calls
`trainer.checkpoint_callback_class`'s `on_save` on the driver after each save, before it logs the
step's metrics. `CheckpointMetricsCallback` reads the reports there and logs their summary through
the trainer's own logger at the same step, so the save's memory and time sit in the same wandb
row as `critic/score/mean` and `val-core/...`.

Use it with:
    trainer.checkpoint_callback_class=slimckpt.verl.ckpt_metrics.CheckpointMetricsCallback
(scripts/train_small.sh and scripts/train_70b.sh pass it). Reports exist when slimckpt measures
saves: with a recipe (SlimCheckpointConfig.measure, on by default) or SLIMCKPT_MEASURE=1 for verl's
own checkpoint config (the launchers set it).

Keys (GB = 1e9 bytes), logged at the step of the save:
  ckpt/blocking_seconds      the time training waited for this save: per role the slowest rank, summed
                             over roles (they save one after another)
  ckpt/ranks                 how many rank reports of this save were found
and, for the last save whose write has committed (this one when it is sync; an async save's
write commits in the background and is logged at the next save after it):
  ckpt/committed_step        the step those numbers belong to
  ckpt/seconds               from the save call to its commit, summed over roles as above
  ckpt/write_seconds         the background write alone (async saves; 0 for sync ones)
  ckpt/bytes_gb              bytes written, summed over ranks and roles
  ckpt/peak_host_rss_gb      max over ranks and roles of the process's peak anonymous RSS from the save
                             call to the commit (an async write's window includes training's own memory)
  ckpt/peak_rss_extra_gb     max over ranks and roles of that peak minus the RSS before the save
  ckpt/staging_pool_gb       max over ranks of the async staging pool held for the run (0 when sync)
  ckpt/throughput_gbps       bytes_gb / seconds
  ckpt/<role>/peak_rss_extra_gb, ckpt/<role>/seconds   the same per role (actor, critic)
The last async save of a run commits at exit, after the last `on_save`: its numbers are in its
commit reports and the log, not in the tracker.
"""

from __future__ import annotations

import time
from typing import Any

from verl.trainer.ppo.checkpoint_callback import CheckpointCallback

from slimckpt.log import get_logger
from slimckpt.observe.save_reports import checkpoint_root, read_commits, read_reports

log = get_logger("slimckpt.ckpt_metrics")

GB = 1e9


def _by_role(reports: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    by_role: dict[str, list[dict[str, Any]]] = {}
    for report in reports:
        by_role.setdefault(str(report["role"]), []).append(report)
    return by_role


def summarize_blocking(reports: list[dict[str, Any]]) -> dict[str, float]:
    """What training waited for, from a save's `save` reports (empty when there are none)."""
    if not reports:
        return {}
    blocking = sum(max(float(r["blocking_seconds"]) for r in rs) for rs in _by_role(reports).values())
    return {"ckpt/blocking_seconds": blocking, "ckpt/ranks": float(len(reports))}


def summarize_committed(reports: list[dict[str, Any]]) -> dict[str, float]:
    """The written save's numbers, from its committed reports (a sync save's `save` reports or an
    async save's `commit` reports; empty when there are none)."""
    if not reports:
        return {}
    by_role = _by_role(reports)
    seconds = sum(max(float(r["seconds"]) for r in rs) for rs in by_role.values())
    total_bytes = sum(int(r["bytes_written"]) for r in reports)
    metrics = {
        "ckpt/committed_step": float(max(int(r["global_step"]) for r in reports)),
        "ckpt/seconds": seconds,
        "ckpt/write_seconds": sum(max(float(r.get("write_seconds", 0.0)) for r in rs) for rs in by_role.values()),
        "ckpt/bytes_gb": total_bytes / GB,
        "ckpt/peak_host_rss_gb": max(int(r["peak_rss_anon_bytes"]) for r in reports) / GB,
        "ckpt/peak_rss_extra_gb": max(int(r["peak_rss_extra_bytes"]) for r in reports) / GB,
        "ckpt/staging_pool_gb": max(int(r.get("staging_pool_bytes", 0)) for r in reports) / GB,
        # async_save=stream: training blocked after the save returned (the guards' waits) and what they copied
        "ckpt/guard_blocked_seconds": sum(
            max(float(r.get("guard_blocked_seconds", 0.0)) for r in rs) for rs in by_role.values()
        ),
        "ckpt/guard_copied_gb": max(int(r.get("guard_copied_bytes", 0)) for r in reports) / GB,
        "ckpt/throughput_gbps": total_bytes / GB / seconds if seconds > 0 else 0.0,
    }
    for role, rs in sorted(by_role.items()):
        metrics[f"ckpt/{role}/peak_rss_extra_gb"] = max(int(r["peak_rss_extra_bytes"]) for r in rs) / GB
        metrics[f"ckpt/{role}/seconds"] = max(float(r["seconds"]) for r in rs)
    return metrics


def summarize(reports: list[dict[str, Any]]) -> dict[str, float]:
    """A sync save's `ckpt/*` metrics from its `save` reports (both halves at once)."""
    return {**summarize_blocking(reports), **summarize_committed([r for r in reports if r.get("committed", True)])}


class CheckpointMetricsCallback(CheckpointCallback):
    """verl CheckpointCallback: log the save's `ckpt/*` metrics at the save's step."""

    def __init__(self, config=None) -> None:
        super().__init__(config)
        # a resumed run rewrites a step dir a killed run may have reported into: only our reports count
        self._started = time.time() - 1.0
        self._logged_commits: set[int] = set()
        self._warned = False

    def metrics_of(self, global_step: int, checkpoint_dir: str) -> dict[str, float]:
        saves = read_reports(checkpoint_dir, global_step, self._started)
        metrics = summarize_blocking(saves)
        committed = [r for r in saves if r.get("committed", True)]
        commits = {
            step: rs
            for step, rs in read_commits(checkpoint_root(checkpoint_dir), self._started).items()
            if step not in self._logged_commits
        }
        if committed:
            commits[int(global_step)] = committed
        if commits:
            newest = max(commits)
            metrics.update(summarize_committed(commits[newest]))
            self._logged_commits.update(commits)
        return metrics

    def on_save(self, trainer, global_step: int, checkpoint_dir: str, async_save: bool = False, **kwargs) -> None:
        metrics = self.metrics_of(global_step, checkpoint_dir)
        if not metrics:
            if not self._warned:
                log.warning(
                    "no slimckpt save reports for %s: ckpt/* metrics need a slimckpt recipe or SLIMCKPT_MEASURE=1",
                    checkpoint_dir,
                )
                self._warned = True
            return
        logger = getattr(trainer, "logger", None)
        if logger is None:
            log.warning("trainer has no logger yet; ckpt/* metrics of step %s not logged", global_step)
            return
        logger.log(data=metrics, step=global_step)
