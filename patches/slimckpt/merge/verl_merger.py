"""verl's `python -m verl.model_merger merge --backend fsdp`, redirected to the streaming merge
(patch "merge.fsdp" in slimckpt.verl.patch_list)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from slimckpt import env_vars
from slimckpt.log import get_logger
from slimckpt.merge.pipeline import merge
from slimckpt.merge.plan import MergeError, MergeOptions

log = get_logger("slimckpt.merge")

OVERWRITE_ENV = "SLIMCKPT_MERGE_OVERWRITE"
WORKERS_ENV = "SLIMCKPT_MERGE_WORKERS"
# verl's parser cannot carry --distributed_merge: ranks share the merge only when asked, never
# because the shell has WORLD_SIZE/RANK (any torchrun, SLURM or PyTorchJob shell has them)
DISTRIBUTED_ENV = "SLIMCKPT_MERGE_DISTRIBUTED"
# `slimckpt merge --no_verl_fallback`: refuse what the streaming merge cannot do instead of handing
# it to verl's own merger (this command's original code), which holds the whole model in host memory
NO_FALLBACK_ENV = "SLIMCKPT_MERGE_NO_VERL_FALLBACK"


def wrap_merge_and_save(original: Callable) -> Callable:
    """FSDPModelMerger.merge_and_save -> the streaming merge for `merge`; verl's own for `test`.

    Every flag of verl's parser still parses. --use_cpu_initialization changes nothing here (no
    model is materialised); --hf_upload_path uploads the committed dir with verl's own uploader;
    --tie-word-embedding/--is-value-model are Megatron-only in verl and ignored by its FSDP
    merger too. Env: SLIMCKPT_MERGE_DISTRIBUTED=1 under torchrun has the ranks share the work
    (`slimckpt merge --distributed_merge`; every rank must join within SLIMCKPT_MERGE_JOIN_TIMEOUT
    seconds, 600 by default); SLIMCKPT_MERGE_WORKERS=N writer processes; SLIMCKPT_MERGE_OVERWRITE=1
    replaces a non-empty target; SLIMCKPT_MERGE_NO_VERL_FALLBACK=1 refuses a checkpoint the
    streaming merge does not handle (a save-time conversion that is not a slice of one tensor)
    instead of running verl's merger on it (verl's parser has no such flags); a LoRA checkpoint is
    streamed to verl's output (base model + lora_adapter/); SLIMCKPT_DISABLE=1 runs verl's merger untouched.
    """

    @functools.wraps(original)
    def merge_and_save(self) -> None:
        cfg = self.config
        if cfg.operation != "merge":
            log.info(
                "slimckpt: 'verl.model_merger %s' runs verl's own FSDPModelMerger (only 'merge' is "
                "streamed by slimckpt)",
                cfg.operation,
            )
            return original(self)
        if cfg.use_cpu_initialization:
            log.info(
                "slimckpt: --use_cpu_initialization has no effect on the streaming merge (no model is "
                "materialised on any device)"
            )
        distributed = env_vars.flag(DISTRIBUTED_ENV)
        if (
            not distributed
            and env_vars.foreign("WORLD_SIZE", "1") not in ("", "0", "1")
            and env_vars.foreign("RANK") is not None
        ):
            log.warning(
                "slimckpt: WORLD_SIZE=%s but %s is not 1: this process merges alone (as verl's merger "
                "would); set %s=1 to share the merge across the torchrun ranks",
                env_vars.foreign("WORLD_SIZE"),
                DISTRIBUTED_ENV,
                DISTRIBUTED_ENV,
            )
        opts = MergeOptions(
            local_dir=cfg.local_dir,
            target_dir=cfg.target_dir,
            trust_remote_code=cfg.trust_remote_code,
            overwrite=env_vars.flag(OVERWRITE_ENV),
            overwrite_hint=f"{OVERWRITE_ENV}=1",
            workers=env_vars.integer(WORKERS_ENV),
            distributed=distributed,
            distributed_hint=f"{DISTRIBUTED_ENV}=1",
            verl_fallback=not env_vars.flag(NO_FALLBACK_ENV),
            verl_fallback_hint=f"{NO_FALLBACK_ENV}=1",
            progress=sys.stderr.isatty() or env_vars.flag("SLIMCKPT_PROGRESS"),
        )
        log.info(
            "slimckpt: 'python -m verl.model_merger merge --backend fsdp' runs slimckpt's streaming merge "
            "(SLIMCKPT_DISABLE=1 runs verl's own)"
        )
        try:
            result = merge(opts, verl_fallback=lambda: original(self))
        except MergeError as exc:  # a distributed rank wrote its line already (distributed.report_together)
            raise SystemExit(1 if getattr(exc, "reported", False) else f"slimckpt merge: error: {exc}") from None
        if cfg.hf_upload and not result.used_verl_merger and env_vars.foreign("RANK", "0") == "0":
            log.info(
                "slimckpt: uploading %s to the Hugging Face Hub as %s (verl's uploader)",
                result.target_dir,
                cfg.hf_upload_path,
            )
            self.upload_to_huggingface()

    return merge_and_save
