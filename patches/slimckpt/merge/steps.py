"""The steps a merge takes alike in one process (`pipeline`) and on torchrun ranks (`distributed`): the
locks on the checkpoint and the target, the plan (or the word that verl's merger has to do it:
`verl_fallback`), the commit of the output with its manifest written last, and the one line a failure
is reported in."""

from __future__ import annotations

import contextlib
import os

import slimckpt.layout.safetensors_layout as layout
from slimckpt import __version__
from slimckpt.engine.merge_input import open_source
from slimckpt.engine.output_dir import commit, write_manifest
from slimckpt.hf.lora import plan_lora
from slimckpt.hf.naming import HfSide, NeedsVerlMerger, default_max_shard_size
from slimckpt.hf.plan import ExportPlan, make_plan
from slimckpt.layout.merge_manifest import DEFAULT_ALGO, MANIFEST_NAME, Manifest, build_entries, check_target
from slimckpt.layout.names import LORA_ADAPTER_CONFIG, LORA_ADAPTER_DIR
from slimckpt.log import get_logger
from slimckpt.merge.plan import MergeError, MergeOptions
from slimckpt.merge.verl_fallback import log_fallback
from slimckpt.merge.workers import is_user_error
from slimckpt.storage.locks import LockBusy, acquire, reading
from slimckpt.storage.os_errors import MERGE_FIXES, OsErrorFixes, redescribe
from slimckpt.verl_files.leaves import leaf

log = get_logger("slimckpt.merge")


def resolve_max_shard_size(opts: MergeOptions) -> None:
    if opts.max_shard_size is None:
        opts.max_shard_size = default_max_shard_size()  # imports transformers


def target_lock(opts: MergeOptions):
    """The exclusive lock on the target (slimckpt.storage.locks), held from before `<target>.partial` is
    made until the commit: a second merge into it fails at once instead of deleting our partial."""
    target = os.path.abspath(opts.target_dir)
    try:
        return acquire(
            target,
            exclusive=True,
            what=f"merging {os.path.abspath(opts.local_dir)} into it",
            fix="wait for that merge to finish, or choose another --target_dir",
        )
    except OSError:
        # no lock file in an unwritable or full parent: nothing can be written there either, and
        # creating `<target>.partial` next reports it in the usual words
        check_target(target, opts.overwrite, opts.overwrite_hint)
        return contextlib.nullcontext()


def source_lock(opts: MergeOptions):
    """A shared lock on the checkpoint while it is read: retention does not delete it meanwhile,
    and a step a trainer is still writing is refused."""
    return (
        reading(opts.local_dir, f"merging it into {os.path.abspath(opts.target_dir)}")
        if opts.lock_source
        else contextlib.nullcontext()
    )


def open_and_plan(opts: MergeOptions) -> tuple[ExportPlan, HfSide] | None:
    """The plan from the rank files, or None when verl's own merger has to do them."""
    ckpt = open_source(opts.local_dir)
    try:
        return plan_or_fallback(ckpt, opts)
    finally:
        ckpt.close()


def plan_or_fallback(ckpt, opts: MergeOptions) -> tuple[ExportPlan, HfSide] | None:
    """The merge plan and HF side, or None when verl's own merger has to do this checkpoint
    (logged with the host memory it takes; a MergeError instead when opts.verl_fallback is off)."""
    hf = HfSide(ckpt.local_dir, opts.dtype, opts.trust_remote_code)
    try:
        if ckpt.has_lora():
            mp = plan_lora(
                ckpt, hf, opts.dtype, opts.max_shard_size, opts.merge_lora, opts.merge_lora_hint, opts.adapter_only
            )
        else:
            if opts.merge_lora:
                log.warning("%s: the checkpoint holds no LoRA weights; merging it as it is", opts.merge_lora_hint)
            mp = make_plan(ckpt, hf, opts.dtype, opts.max_shard_size)
    except NeedsVerlMerger as exc:
        log_fallback(opts, str(exc), ckpt)
        return None
    return mp, hf


def log_start(opts: MergeOptions, target: str, mp: ExportPlan, ranks: int | None = None) -> None:
    """The merge's first line: what goes where, and how many processes write it."""
    writers = f"{opts.workers} worker(s)" if ranks is None else f"{ranks} rank(s) x {opts.workers} worker(s)"
    log.info(
        "slimckpt streaming merge: %s -> %s (%d tensors, %.2f GB %s in %d file(s), %s)",
        opts.local_dir,
        target,
        len(mp.name_map),
        mp.weight_bytes / 1e9,
        opts.dtype,
        len(mp.plan.files),
        writers,
    )


def log_committed(target: str, seconds: float) -> None:
    log.info("slimckpt merge committed %s in %.1f s (%s written last)", target, seconds, MANIFEST_NAME)


def finish(
    partial: str, target: str, mp: ExportPlan, checksums: dict[str, str], opts: MergeOptions, tokenizer_saved: bool
) -> list[str]:
    if not mp.model_plan.files and mp.adapter_config is not None:  # save_lora_only: lora_adapter/ alone
        missing = [
            n
            for n in [LORA_ADAPTER_CONFIG, *(f.name.split("/")[-1] for f in mp.plan.files)]
            if not os.path.getsize(os.path.join(partial, LORA_ADAPTER_DIR, n))
        ]
        if missing:
            raise MergeError(f"Incomplete LoRA adapter output at {partial}: {LORA_ADAPTER_DIR}/{missing[0]} is empty")
    else:
        try:
            leaf("output_validation").validate_hf_model_output(partial)
        except RuntimeError as exc:
            raise MergeError(str(exc)) from None
    entries = build_entries(partial, known=checksums)
    manifest = Manifest(
        kind="hf_export",
        files=entries,
        tool_version=__version__,
        checksum_algo=DEFAULT_ALGO,
        info={
            "source": {
                "local_dir": opts.source_name or os.path.abspath(opts.local_dir),
                "format": mp.source_format,
                "fsdp_version": mp.fsdp_version,
                "world_size": mp.world_size,
            },
            "dtype": opts.dtype,
            "max_shard_size": layout.parse_size(opts.max_shard_size),
            "weight_files": [f.name for f in mp.model_plan.files],
            "total_size": mp.model_plan.total_size,
            **(
                {"lora_adapter": [f.name for f in mp.plan.files if f not in mp.model_plan.files]}
                if mp.adapter_config is not None
                else {}
            ),
            **({"merge_lora": True} if opts.merge_lora and any(t.delta for t in mp.takes.values()) else {}),
            "tokenizer": tokenizer_saved,
        },
    )
    write_manifest(partial, manifest)
    commit(partial, target, overwrite=opts.overwrite)
    return sorted(entries) + [MANIFEST_NAME]


def message(exc: BaseException, fixes: OsErrorFixes = MERGE_FIXES) -> str:
    line = redescribe(exc, fixes)  # a full or unwritable output: the fix of whoever asked for the merge
    if line is not None:
        return line
    return (
        str(exc)
        if is_user_error(exc) or isinstance(exc, (layout.LayoutError, LockBusy))
        else f"{type(exc).__name__}: {exc}"
    )
