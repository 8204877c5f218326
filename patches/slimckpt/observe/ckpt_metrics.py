"""`ckpt/*` metrics in verl's tracker (wandb, console, ...), at the step of each save.

Every rank of every role writes `slimckpt_save_rank_{r}.json` next to its shards when it saves
(slimckpt.save.hooks: peak anonymous RSS, bytes, seconds). verl 0.9.1's v1 trainer calls
`trainer.checkpoint_callback_class`'s `on_save` on the driver after each save, before it logs the
step's metrics. `CheckpointMetricsCallback` reads that step's JSONs and logs their summary through
the trainer's own logger at the same step, so the save's memory and time sit in the same wandb
row as `critic/score/mean` and `val-core/...`.

Use it with:
    trainer.checkpoint_callback_class=slimckpt.observe.ckpt_metrics.CheckpointMetricsCallback
(scripts/train_small.sh and scripts/train_70b.sh pass it). The JSONs exist when slimckpt measures
saves: with a recipe (SlimCheckpointConfig.measure, on by default) or SLIMCKPT_MEASURE=1 for verl's
own checkpoint config (the launchers set it).

Keys (GB = 1e9 bytes):
  ckpt/peak_host_rss_gb      max over ranks and roles of the process's peak anonymous RSS during the save
  ckpt/peak_rss_extra_gb     max over ranks and roles of that peak minus the RSS before the save
  ckpt/bytes_gb              bytes written, summed over ranks and roles
  ckpt/seconds               wall time: per role the slowest rank, summed over roles (they save one after another)
  ckpt/blocking_seconds      the part of it training waited for (equal to seconds unless the save is async)
  ckpt/throughput_gbps       bytes_gb / seconds
  ckpt/ranks                 how many rank reports were found
  ckpt/<role>/peak_rss_extra_gb, ckpt/<role>/seconds   the same per role (actor, critic)
"""

from __future__ import annotations

import glob
import json
import os
import time
from typing import Any

from verl.trainer.ppo.checkpoint_callback import CheckpointCallback

from ..log import get_logger

log = get_logger("slimckpt.ckpt_metrics")

REPORT_GLOB = "slimckpt_save_rank_*.json"
GB = 1e9


def read_reports(checkpoint_dir: str, global_step: int, not_before: float = 0.0) -> list[dict[str, Any]]:
    """Per-rank save reports of one step dir (`<dir>/<role>/slimckpt_save_rank_*.json`); reports of
    another step or older than `not_before` (a previous run's save of the same step) are skipped."""
    reports = []
    for path in sorted(glob.glob(os.path.join(checkpoint_dir, "*", REPORT_GLOB))):
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, ValueError) as exc:
            log.warning("skipping unreadable save report %s: %s", path, exc)
            continue
        if int(report.get("global_step", -1)) != int(global_step) or float(report.get("time", 0.0)) < not_before:
            continue
        report.setdefault("role", os.path.basename(os.path.dirname(path)))
        reports.append(report)
    return reports


def summarize(reports: list[dict[str, Any]]) -> dict[str, float]:
    """The `ckpt/*` metrics of one save from its per-rank reports (empty when there are none)."""
    if not reports:
        return {}
    by_role: dict[str, list[dict[str, Any]]] = {}
    for report in reports:
        by_role.setdefault(str(report["role"]), []).append(report)
    seconds = sum(max(float(r["seconds"]) for r in rs) for rs in by_role.values())
    blocking = sum(max(float(r.get("blocking_seconds", r["seconds"])) for r in rs) for rs in by_role.values())
    total_bytes = sum(int(r["bytes_written"]) for r in reports)
    metrics = {
        "ckpt/peak_host_rss_gb": max(int(r["peak_rss_anon_bytes"]) for r in reports) / GB,
        "ckpt/peak_rss_extra_gb": max(int(r["peak_rss_extra_bytes"]) for r in reports) / GB,
        "ckpt/bytes_gb": total_bytes / GB,
        "ckpt/seconds": seconds,
        "ckpt/blocking_seconds": blocking,
        "ckpt/throughput_gbps": total_bytes / GB / seconds if seconds > 0 else 0.0,
        "ckpt/ranks": float(len(reports)),
    }
    for role, rs in sorted(by_role.items()):
        metrics[f"ckpt/{role}/peak_rss_extra_gb"] = max(int(r["peak_rss_extra_bytes"]) for r in rs) / GB
        metrics[f"ckpt/{role}/seconds"] = max(float(r["seconds"]) for r in rs)
    return metrics


class CheckpointMetricsCallback(CheckpointCallback):
    """verl CheckpointCallback: log the save's `ckpt/*` metrics at the save's step."""

    def __init__(self, config=None) -> None:
        super().__init__(config)
        # a resumed run rewrites a step dir a killed run may have reported into: only our reports count
        self._started = time.time() - 1.0
        self._warned = False

    def on_save(self, trainer, global_step: int, checkpoint_dir: str, async_save: bool = False, **kwargs) -> None:
        metrics = summarize(read_reports(checkpoint_dir, global_step, self._started))
        if not metrics:
            if not self._warned:
                log.warning("no slimckpt save reports in %s: ckpt/* metrics need a slimckpt recipe or "
                            "SLIMCKPT_MEASURE=1", checkpoint_dir)
                self._warned = True
            return
        logger = getattr(trainer, "logger", None)
        if logger is None:
            log.warning("trainer has no logger yet; ckpt/* metrics of step %s not logged", global_step)
            return
        logger.log(data=metrics, step=global_step)
