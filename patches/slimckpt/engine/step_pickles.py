"""Every pickle a load of a checkpoint dir would unpickle, checked against pickle_policy without
running any of it, so a refusal comes before the load starts (and, in a distributed load, on
every rank at once rather than inside one rank's collective).

- an incremental-tier step: `dcp/.metadata`, DCP's non-tensor records in the `.distcp` files (the
  optimizer's param_groups and other Python values; tensor records torch reads with
  weights_only=True), and the extra state (`slimckpt_extra_*.pt`);
- a verl-native dir: `{model,optim,extra_state}_world_size_{W}_rank_{r}.pt`, which verl's own
  load unpickles with weights_only=False.

A step's manifest checksums say the files are the ones written; they cannot say the writer was
honest, so these checks run on committed steps too.
"""

from __future__ import annotations

# lazy imports: torch-free (verify and the native check run without torch) until a dcp/ step's byte records are read
import os
from collections.abc import Iterable

from slimckpt.engine.checkpoint_dir import DCP_DIR
from slimckpt.engine.pickle_policy import PickleRefused, check_file, check_torch_bytes, trusted
from slimckpt.storage import for_path, is_url

EXTRA_PREFIX = "slimckpt_extra_"  # save.extra_state.EXTRA_PREFIX (that module imports torch)
VERL_RANK_KINDS = ("model", "optim", "extra_state")  # what FSDPCheckpointManager.load_checkpoint torch.loads


def dcp_refusals(role_dir: str, extra_files: Iterable[str] | None = None) -> list[PickleRefused]:
    """The refused pickles of an incremental role dir: its `.metadata`, the non-tensor records it
    lists, and `extra_files` (paths; None: every `slimckpt_extra_*.pt` of the dir)."""
    if trusted():
        return []
    if extra_files is None:
        extra_files = [
            os.path.join(role_dir, n)
            for n in for_path(role_dir).list_dir(role_dir)
            if n.startswith(EXTRA_PREFIX) and n.endswith(".pt")
        ]
    out: list[PickleRefused] = []
    for path in extra_files:
        _collect(out, check_file, path)
    dcp_dir = os.path.join(role_dir, DCP_DIR)
    meta = os.path.join(dcp_dir, ".metadata")
    if for_path(meta).exists(meta) and _collect(out, check_file, meta):
        out += _bytes_records(dcp_dir)
    return out


def native_refusals(local_path: str, world_size: int, rank: int) -> list[PickleRefused]:
    """The refused pickles among the files verl's load of `local_path` unpickles on `rank` (missing
    files are left to verl, which reports them)."""
    if trusted():
        return []
    out: list[PickleRefused] = []
    for kind in VERL_RANK_KINDS:
        path = os.path.join(local_path, f"{kind}_world_size_{world_size}_rank_{rank}.pt")
        if os.path.isfile(path):
            _collect(out, check_file, path)
    return out


def _collect(out: list[PickleRefused], check, *args) -> bool:
    try:
        check(*args)
    except PickleRefused as exc:
        out.append(exc)
        return False
    return True


def _bytes_records(dcp_dir: str) -> list[PickleRefused]:
    from slimckpt.engine.dcp_pickle import byte_record_keys, read_metadata

    try:
        metadata = read_metadata(dcp_dir)
    except Exception:  # noqa: BLE001 - damage the manifest's checksums (or the load) report
        return []
    bytes_keys = byte_record_keys(metadata)
    out: list[PickleRefused] = []
    handles: dict[str, object] = {}
    try:
        for index, info in (metadata.storage_data or {}).items():
            if index.fqn not in bytes_keys:
                continue
            path = os.path.join(dcp_dir, info.relative_path)
            try:
                if is_url(path):
                    data = for_path(path).read_range(path, info.offset, info.length)
                else:
                    if path not in handles:
                        handles[path] = open(path, "rb")
                    f = handles[path]
                    f.seek(info.offset)
                    data = f.read(info.length)
            except OSError:
                continue  # missing or short: the manifest's sizes report it
            try:
                check_torch_bytes(data, path)
            except PickleRefused as exc:
                out.append(PickleRefused(path, exc.global_name, f"the record of {index.fqn}"))
    finally:
        for f in handles.values():
            f.close()
    return out
