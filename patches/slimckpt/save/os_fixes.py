"""A full or unwritable checkpoint directory in a trainer's words: what a user running verl's
trainer can change (trainer.default_local_dir, max_*_ckpt_to_keep, checkpoint.on_save_error),
where `slimckpt merge`'s words are about its --target_dir (format.os_errors.MERGE_FIXES)."""

from __future__ import annotations

import os

from slimckpt.storage.os_errors import OsErrorFixes

CONTINUE_HINT = "or set checkpoint.on_save_error=continue to train on without this save"


def trainer_fixes(local_path: str) -> OsErrorFixes:
    """The fixes for a save into `local_path` (a role dir: its role names the retention key)."""
    role = os.path.basename(os.path.normpath(local_path))
    keep = f"max_{role}_ckpt_to_keep" if role in ("actor", "critic") else "max_actor_ckpt_to_keep"
    return OsErrorFixes(
        full=f"free space there, lower trainer.{keep}, or point trainer.default_local_dir at a larger filesystem, "
        f"{CONTINUE_HINT}",
        not_writable=f"make it writable or point trainer.default_local_dir at a writable directory, {CONTINUE_HINT}",
    )
