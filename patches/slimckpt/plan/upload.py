"""What a save costs on an object store (`slimckpt plan --storage s3`): the bytes each rank uploads,
the time until the step is durable, and the host memory the upload's buffers take. Pure arithmetic
(no client library, no credentials, no network), unit-tested.

The model, as slimckpt.storage.s3 uploads: every rank streams its own rank files as multipart uploads
straight from its shards, holding at most `concurrency` parts of `part_bytes` (the one being filled,
the rest in flight; one more being filled per further file open at once: DCP's write threads); so the
upload adds part x concurrency to a rank's host memory, plus a fixed slack for the client's own
buffers, whatever the model size. The step is durable once every rank's uploads
are complete and one conditional PUT of the manifest (If-None-Match: *) has committed it: the bytes at
the job's aggregate bandwidth to the store, then one request. What a store does slower (a per-prefix
request rate; one process's `concurrency` connections below its share) is not modelled.

Only slimckpt's incremental writer uploads. verl's own rank files (verl's save, and the quickstart
and intermediate recipes, which keep verl's model shards) are written with torch.save to a local
path and refuse an s3:// directory. The in-training HF export needs a medium with in-place writes
(every rank writes its rows of each file at their offsets); on one without, the run sets
export_hf=false and `slimckpt merge` writes the HF model from the committed step, then uploads it
from one process, its manifest last (slimckpt.merge.remote).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slimckpt.plan.assumed import DEFAULT_CONCURRENCY, DEFAULT_PART_MB, DEFAULT_UPLOAD_GBPS, SLACK_BYTES
from slimckpt.plan.cost import human
from slimckpt.storage.s3_client import MAX_PART, MIN_PART
from slimckpt.storage.s3_upload import MAX_PARTS

COMMIT_SECONDS = 0.1  # one conditional PUT of a small manifest: a request's round trip, assumed
MIN_PART_MB, MAX_PART_MB = MIN_PART >> 20, MAX_PART >> 20
REFUSED = "incremental only: verl's own rank files (torch.save to a local path) refuse s3://"
EXPORT_REFUSED = (
    "the in-training HF export needs in-place writes, which s3:// has not: the run sets "
    "actor_rollout_ref.actor.checkpoint.export_hf=false (else its first save stops, saying so) and "
    "`slimckpt merge --target_dir s3://...` writes the HF model from the step (the merge row)"
)


@dataclass(frozen=True)
class UploadSettings:
    """How the plan uploads: the job's aggregate bandwidth and the backend's multipart settings."""

    gbps: float
    part_bytes: int = DEFAULT_PART_MB * 2**20
    concurrency: int = DEFAULT_CONCURRENCY
    gbps_source: str = "default"

    @property
    def buffer_bytes(self) -> int:
        """Extra host memory of a process uploading one file at a time: its parts, plus the slack."""
        return self.buffers_for(1)

    def buffers_for(self, streams: int) -> int:
        """The same with `streams` files open at once (DCP's write threads): the process's parts are
        shared by its uploads, and each further open file fills one part of its own beside them."""
        return self.part_bytes * (self.concurrency + max(0, streams - 1)) + SLACK_BYTES


def upload_settings(gbps: float | None, part_mb: int | None, concurrency: int | None) -> UploadSettings:
    """The settings from `slimckpt plan`'s options (None: the default), or ValueError naming the option."""
    if gbps is not None and not gbps > 0:
        raise ValueError(f"slimckpt plan: --upload-gbps {gbps:g}: give a bandwidth above 0 GB/s")
    part = DEFAULT_PART_MB if part_mb is None else int(part_mb)
    if not MIN_PART_MB <= part <= MAX_PART_MB:
        raise ValueError(
            f"slimckpt plan: --s3-part-mb {part}: S3 parts are {MIN_PART_MB} MiB to {MAX_PART_MB} MiB; "
            f"give a size in that range (default {DEFAULT_PART_MB})"
        )
    flight = DEFAULT_CONCURRENCY if concurrency is None else int(concurrency)
    if flight < 1:
        raise ValueError(f"slimckpt plan: --s3-concurrency {flight}: give 1 or more parts in flight")
    return UploadSettings(
        gbps=float(DEFAULT_UPLOAD_GBPS if gbps is None else gbps),
        part_bytes=part * 2**20,
        concurrency=flight,
        gbps_source="default: one 10 Gb/s link" if gbps is None else "--upload-gbps",
    )


def rank_share(total: int, rank_bytes: int, all_bytes: int) -> int:
    """A rank's part of `total` when every rank writes its own rows: in proportion to the rows it
    holds (`rank_bytes` of `all_bytes`), rounded up."""
    if not all_bytes:
        return 0
    return -(-total * rank_bytes // all_bytes)


def seconds_at(nbytes: int, gbps: float) -> float:
    return nbytes / (gbps * 1e9)


def min_part_bytes(file_bytes: int) -> int:
    """The smallest whole-MiB part that uploads `file_bytes` in at most MAX_PARTS parts (at least S3's minimum)."""
    mib = -(-file_bytes // (MAX_PARTS * 2**20))
    return max(MIN_PART_MB, mib) * 2**20


def part_notes(largest_file: int, settings: UploadSettings, what: str) -> list[str]:
    """A file more parts long than S3 takes in one upload, and the part size that fits it."""
    if -(-largest_file // settings.part_bytes) <= MAX_PARTS:
        return []
    need = min_part_bytes(largest_file)
    return [
        f"{what} (~{human(largest_file)}) is more than {MAX_PARTS:,} parts of {human(settings.part_bytes)}, "
        f"S3's limit for one upload: the run sets SLIMCKPT_S3_PART_MB={need >> 20} or more (here --s3-part-mb "
        f"{need >> 20}; the upload buffers grow to {human(need * settings.concurrency + SLACK_BYTES)})"
    ]


def save_upload(
    rank_state: int,
    all_state: int,
    rank_export: int,
    all_export: int,
    largest_file: int,
    host_peak: int,
    settings: UploadSettings,
    inplace_writes: bool = False,
    streams: int = 1,
) -> dict[str, Any]:
    """One incremental save to s3://: the largest rank's bytes (resume state `rank_state` and its
    rows of the HF export `rank_export`) and all ranks', the time until the step is committed, and
    the rank's host memory with the upload's buffers (`streams` files written at once) on top of the
    save's own `host_peak`. Without
    `inplace_writes` (the backend's) an export is not uploaded: the run turns it off (EXPORT_REFUSED)."""
    refused_export = bool(all_export) and not inplace_writes
    if refused_export:
        rank_export = all_export = 0
    total = all_state + all_export
    upload_s = seconds_at(total, settings.gbps)
    return {
        "supported": True,
        "rank0_upload_bytes": rank_state + rank_export,
        "total_upload_bytes": total,
        "rank0_export_upload_bytes": rank_export,
        "export_upload_bytes": all_export,
        "export_refused": EXPORT_REFUSED if refused_export else None,
        "upload_seconds": upload_s,
        "commit_seconds": COMMIT_SECONDS,
        "durable_seconds": upload_s + COMMIT_SECONDS,
        "upload_buffer_bytes": settings.buffers_for(streams),
        "host_peak_with_upload_bytes": host_peak + settings.buffers_for(streams),
        "largest_file_bytes": largest_file,
        "notes": part_notes(largest_file, settings, "a rank file"),
    }


def refused(reason: str = REFUSED) -> dict[str, Any]:
    """A row the S3 path cannot save today, and why."""
    return {"supported": False, "reason": reason}


def merge_upload(export_bytes: int, largest_file: int, gbps: float, source: str, settings: UploadSettings) -> dict:
    """`slimckpt merge --target_dir s3://...`: the HF model, merged into local scratch first, then
    uploaded file by file by one process at `gbps` (its node's share) and committed by its manifest;
    that process holds one upload's buffers on top of the merge's own bound."""
    upload_s = seconds_at(export_bytes, gbps)
    return {
        "total_upload_bytes": export_bytes,
        "gbps": gbps,
        "gbps_source": source,
        "upload_seconds": upload_s,
        "commit_seconds": COMMIT_SECONDS,
        "durable_seconds": upload_s + COMMIT_SECONDS,
        "upload_buffer_bytes": settings.buffer_bytes,
        "largest_file_bytes": largest_file,
        "notes": part_notes(largest_file, settings, "an HF file"),
    }
