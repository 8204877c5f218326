"""`slimckpt convert` of a step on a remote medium (`s3://.../global_step_N`) into a local verl checkpoint.

    1. the URL checked before anything is written (endpoint, credentials, bucket: one line)
    2. each role of the step mirrored into a scratch dir inside the target root (read.remote_step:
       every record kept, since the optimizer is converted too; every checksum checked as it streams)
    3. the dataloader's data.pt, if the step has one, copied whole
    4. the local convert on the mirror; the scratch dir removed, whatever happened

Host memory stays the local convert's plus one read block per file fetched; local disk holds the
step's files while it runs (and the converted step).
"""

from __future__ import annotations

import os
import tempfile

from tqdm import tqdm

from slimckpt.convert.plan import ConvertError, parse_step_dir
from slimckpt.engine.remote_step import READ_BLOCK, fetch_step
from slimckpt.layout.resume_manifest import UncommittedCheckpoint, read_manifest
from slimckpt.storage import UnknownStorage, for_path

DATA_FILE = "data.pt"


def mirror_step(url: str, target_root: str, progress: bool = False) -> tuple[str, str]:
    """(scratch dir to remove, local global_step_N dir mirroring `url`) inside `target_root`."""
    try:
        store = for_path(url)
        store.check_access(url)
    except (OSError, UnknownStorage) as exc:
        raise ConvertError(str(exc)) from None
    root, step, roles = parse_step_dir(url)
    name = f"global_step_{step}"
    url = f"{root}/{name}"
    os.makedirs(target_root, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".slimckpt-convert-", dir=target_root)
    local_step = os.path.join(scratch, name)
    try:
        total = sum(e.size for role in roles for e in read_manifest(f"{url}/{role}").files)
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="fetch", disable=not progress)
        with bar:
            for role in roles:
                fetch_step(f"{url}/{role}", os.path.join(local_step, role), on_bytes=bar.update)
        data = f"{url}/{DATA_FILE}"
        if store.exists(data):
            with store.open_read(data) as src, open(os.path.join(local_step, DATA_FILE), "wb") as dst:
                while block := src.read(READ_BLOCK):
                    dst.write(block)
    except UncommittedCheckpoint as exc:
        for_path(scratch).remove_tree(scratch, ignore_errors=True)
        raise ConvertError(str(exc).removeprefix("slimckpt: ")) from None
    except BaseException:
        for_path(scratch).remove_tree(scratch, ignore_errors=True)
        raise
    return scratch, local_step


__all__ = ["mirror_step"]
