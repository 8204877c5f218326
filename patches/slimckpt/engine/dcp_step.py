"""An incremental-tier step as the merge's input, without torch: is a role dir one (dcp/, no verl
rank files), and may it be merged (committed, intact, with base weights). The merge checks this
before its imports, as `checkpoint_dir` does for verl's rank files; `dcp_source` reads the tensors.
"""

from __future__ import annotations

import os

from slimckpt.engine.checkpoint_dir import DCP_DIR, HF_SUBDIR, MODEL_FILE_RE, CheckpointError
from slimckpt.layout.resume_manifest import MANIFEST_NAME, Manifest, UncommittedCheckpoint, check_committed

SOURCE_FORMAT = "slimckpt_dcp"  # the merge manifest's source format for such a step
LORA_ONLY_KEY = "lora_only"  # save.state_dicts.LORA_ONLY_KEY (that module imports torch.distributed)


def is_dcp_role_dir(local_dir: str) -> bool:
    """An incremental-tier role dir: dcp/ and none of verl's model rank files."""
    if not os.path.isdir(os.path.join(local_dir, DCP_DIR)):
        return False
    return not any(MODEL_FILE_RE.match(n) for n in os.listdir(local_dir))


def check_step(local_dir: str, checksums: bool = True) -> Manifest:
    """The committed, undamaged manifest of a step whose base weights can be merged; else
    CheckpointError with one line. The check a resume makes: the manifest's seal, every listed
    file's size and (`checksums`) checksum, no unlisted files or failure markers."""
    try:
        manifest = check_committed(local_dir, checksums=checksums)
    except UncommittedCheckpoint as exc:
        line = str(exc).removeprefix("slimckpt: ")
        raise CheckpointError(
            f"{line} (a merge reads only a committed, intact step: merge an earlier global_step_*)"
        ) from None
    if "model" not in manifest.contents:
        raise CheckpointError(
            f"{os.path.join(local_dir, MANIFEST_NAME)}: this step was saved with contents "
            f"{manifest.contents}, without the model; merge a step saved with 'model' in "
            f"checkpoint.save_contents"
        )
    if manifest.extra.get(LORA_ONLY_KEY):
        hf = os.path.join(local_dir, HF_SUBDIR, "lora_adapter")
        where = (
            f"its adapter is {hf} (the save's export)"
            if os.path.isdir(hf)
            else "export_hf=false left no lora_adapter/ export of it"
        )
        raise CheckpointError(
            f"{local_dir} was saved with save_lora_only: it holds the LoRA adapter and no base "
            f"weights, so there is no model to merge; {where}: load it onto the base model "
            f"(actor_rollout_ref.model.path) with peft, or save with save_lora_only=false"
        )
    return manifest
