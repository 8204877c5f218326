"""Resume when verl's tracker file was cut short by a kill.

verl's trainers write `latest_checkpointed_iteration.txt` with `open(path, "w")` then `write`: a
process killed between the two leaves an empty file, and the next `resume_mode=auto` dies on
`int('')` (seen in `make faults`: 1 in 50 kills of quickstart saves, and of verl's default path).
With a recipe on, that write is atomic (`tracker_write`); a tracker cut short by plain verl (a
run from before the recipe was added, or one that left it) is still met on the read side.

The read side repairs it. verl writes the tracker only after every role of the step is
saved and `data.pt` is written, so an empty tracker means the newest step holding `data.pt` had
finished saving when the kill came: resuming from it is exact. A step counts as complete when it
has `data.pt`, no slimckpt failure marker, and every role dir is either committed by slimckpt's
manifest or (verl's own format) holds `fsdp_config.json`. No complete step: a clean start, said
in the log. The function is patched where the trainers imported it (they bound the name).
On object storage (`s3://`) the step is the newest committed one there (trainer_storage).
"""

from __future__ import annotations

import functools
import os

from slimckpt.engine.checkpoint_dir import DCP_DIR
from slimckpt.layout.resume_manifest import TRACKER_NAME, failure_markers, has_manifest, read_tracker, saved_steps
from slimckpt.log import get_logger
from slimckpt.save.driver.trainer_storage import latest_committed_step
from slimckpt.storage import is_url

log = get_logger("slimckpt.tracker")


def role_complete(role_dir: str) -> bool:
    if failure_markers(role_dir):
        return False
    if has_manifest(role_dir):
        return True
    if os.path.isdir(os.path.join(role_dir, DCP_DIR)):
        return False  # slimckpt's format without its manifest: not committed
    return os.path.isfile(os.path.join(role_dir, "fsdp_config.json"))


def step_complete(step_dir: str) -> bool:
    if not os.path.isfile(os.path.join(step_dir, "data.pt")):
        return False
    roles = [os.path.join(step_dir, n) for n in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, n))]
    return bool(roles) and all(role_complete(r) for r in roles)


def newest_complete_step(root: str) -> int | None:
    steps = reversed(saved_steps(root))
    return next((s for s in steps if step_complete(os.path.join(root, f"global_step_{s}"))), None)


def wrap_find_latest_ckpt_path(original):
    @functools.wraps(original)
    def find_latest_ckpt_path(path, directory_format="global_step_{}"):
        if path is None or directory_format != "global_step_{}":
            return original(path, directory_format)
        if is_url(path):  # object storage: the newest committed step, the tracker only a hint
            step = latest_committed_step(path)
            return None if step is None else os.path.join(path, f"global_step_{step}")
        tracker = os.path.join(path, TRACKER_NAME)
        if not os.path.exists(tracker) or read_tracker(path) is not None:
            return original(path, directory_format)
        step = newest_complete_step(path)
        if step is None:
            log.warning(
                "%s is empty or unreadable (a kill during verl's tracker write) and no complete step is "
                "there: starting from scratch",
                tracker,
            )
            return None
        log.warning(
            "%s is empty or unreadable (a kill during verl's tracker write): resuming from global_step_%d, "
            "the newest step whose save had finished (data.pt and every role complete)",
            tracker,
            step,
        )
        return os.path.join(path, f"global_step_{step}")

    return find_latest_ckpt_path
