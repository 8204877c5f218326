"""The metric retention's keep_best ranks steps by: logged by the trainer, recorded next to the step.

Retention runs in the workers (inside the actor's and critic's save), which never see the
trainer's metrics; the trainer logs them through verl's `Tracking.log(data, step)` after the
step's save (and its validation, at test_freq). So the driver records them where the workers
look: `<default_local_dir>/global_step_N/slimckpt_metrics.json` ({"step": N, "metrics": {name:
value}}, every finite number logged at that step, written atomically, merged over the step's log
calls). The next save's retention reads the value of `best_metric` of each older step; the newest
step has none yet, but it is among the newest kept anyway. A step with no value (not a save step
of the metric: a validation metric at a test_freq that does not divide save_freq) is never best.

Recording is on only where a role's checkpoint config asks for keep_best (a recipe's
SlimCheckpointConfig with keep_best > 0): the trainer's Tracking is built with the whole config.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from slimckpt.engine.resume_records import atomic_write_text
from slimckpt.log import get_logger
from slimckpt.options.checkpoint_options import ROLE_SECTIONS, role_options
from slimckpt.save.driver.driver_state import driver_state_of
from slimckpt.storage import absolute, for_path

log = get_logger("slimckpt.retention")

METRICS_NAME = "slimckpt_metrics.json"


def _number(value: Any) -> float | None:
    try:
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, bool):
            return None
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def record(step_dir: str, step: int, data: Mapping[str, Any]) -> None:
    """Add the finite numbers of `data` to the step's metrics file (created on first call)."""
    path = os.path.join(step_dir, METRICS_NAME)
    known: dict[str, float] = {}
    try:
        known = dict(_read_json(path).get("metrics") or {})
    except (OSError, ValueError, AttributeError):
        pass
    known.update({str(k): n for k, v in data.items() if (n := _number(v)) is not None})
    atomic_write_text(path, json.dumps({"step": int(step), "metrics": known}, indent=0, sort_keys=True))


def _read_json(path: str) -> dict:
    with for_path(path).open_read(path) as f:
        return json.loads(f.read().decode("utf-8"))


def step_metric(step_dir: str, name: str) -> float | None:
    try:
        return _number((_read_json(os.path.join(step_dir, METRICS_NAME)).get("metrics") or {}).get(name))
    except (OSError, ValueError, AttributeError):
        return None


def metrics_of(paths: Sequence[str], name: str | None) -> dict[str, float | None]:
    """{role dir: the value of `name` logged at its step} (the step dir is the role dir's parent)."""
    if not name:
        return {}
    return {p: step_metric(os.path.dirname(absolute(p).rstrip("/")), name) for p in paths}


# --------------------------------------------------------------------------- the driver patches


def _wants_metrics(config: Mapping[str, Any]) -> bool:
    return any((options := role_options(config, role)) is not None and options.keep_best for role in ROLE_SECTIONS)


def wrap_tracking_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        config = kwargs.get("config", args[3] if len(args) > 3 else None)
        root = None
        try:
            if isinstance(config, Mapping) and _wants_metrics(config):
                root = (config.get("trainer") or {}).get("default_local_dir")
        except Exception:  # noqa: BLE001 - a config we cannot read records nothing; the run goes on
            log.debug("keep_best: cannot read the trainer config", exc_info=True)
        if root:
            state = driver_state_of(self)
            state.metrics_root = absolute(root)
            log.info(
                "keep_best: the metrics of each save step are recorded in %s/global_step_N/%s",
                state.metrics_root,
                METRICS_NAME,
            )

    return __init__


def wrap_tracking_log(original):
    @functools.wraps(original)
    def log_metrics(self, data, step, *args, **kwargs):
        result = original(self, data, step, *args, **kwargs)
        root = driver_state_of(self).metrics_root
        if root and isinstance(data, Mapping):
            step_dir = os.path.join(root, f"global_step_{int(step)}")
            if for_path(step_dir).is_dir(step_dir):  # a save step (the save came first in verl's loop)
                try:
                    record(step_dir, int(step), data)
                except OSError as exc:  # the metric is for retention only: training goes on
                    log.warning(
                        "keep_best: cannot record step %s's metrics in %s (%s); retention will not rank it",
                        step,
                        step_dir,
                        exc.strerror or exc,
                    )
        return result

    return log_metrics


__all__ = ["METRICS_NAME", "metrics_of", "record", "step_metric", "wrap_tracking_init", "wrap_tracking_log"]
