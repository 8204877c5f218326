"""verl's own merger, run in this process: what a merge falls back to for a checkpoint its streaming
merge cannot write (allow_verl_fallback), with verl's exact code and output.

verl is imported only when the fallback runs, so the merge stays verl-free until then; slimckpt's
redirect of verl's merger (patch "merge.fsdp") is undone for this one call.
"""

# lazy imports: verl's merger (and verl with it) only when a checkpoint needs the fallback
from __future__ import annotations

import os
from collections.abc import Callable


def verl_merger_call(
    local_dir: str, target_dir: str, hf_config_dir: str, trust_remote_code: bool
) -> Callable[[], None]:
    """A call that runs verl's unpatched FSDP merger from `local_dir` into `target_dir`."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    os.makedirs(target_dir, exist_ok=True)
    config = ModelMergerConfig(
        operation="merge",
        backend="fsdp",
        local_dir=local_dir,
        target_dir=target_dir,
        trust_remote_code=trust_remote_code,
        hf_model_config_path=hf_config_dir,
    )
    merger = FSDPModelMerger(config)
    original = getattr(FSDPModelMerger.merge_and_save, "__wrapped__", FSDPModelMerger.merge_and_save)
    return lambda: original(merger)


__all__ = ["verl_merger_call"]
