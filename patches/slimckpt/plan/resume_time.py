"""How long a resume's check and `slimckpt convert` take for one incremental step: the arithmetic, pure.

A resume checks the step before it loads it (checkpoint.verify, on by default): the driver looks at
sizes and seals only; every rank reads and checksums its share of the listed files, so the whole
step is read once at the storage's aggregate bandwidth (--disk-gbps), or at the rank's hashing
speed if that is lower. Were one host to checksum the step, it would read it all at its node's
share of that bandwidth (--writer-gbps, the same figure a lone writer gets).

`slimckpt convert <step> --to verl` is one process on one host: it reads the step's resume state
(model, optimizer, extra state) and writes it again as verl's rank files, fsyncing each, at the
node's share.

xxh3_128 hashes at 34 GB/s on one core of the 2-core CPU host the project is developed on (16 MiB
buffers, Python's xxhash); HASH_GBPS is half of that, for a core shared with the load's reads.
"""

from __future__ import annotations

from typing import Any

HASH_GBPS = 17.0


def resume_times(
    resume_bytes: int, world_size: int, disk_gbps: float | None, node_gbps: float | None, verify: bool = True
) -> dict[str, Any]:
    """Seconds of a resume's check (spread over the ranks, and on one host for comparison) and of a
    convert, for a step of `resume_bytes` (None where a bandwidth is not given)."""
    share = resume_bytes / max(1, world_size)
    spread = None
    if disk_gbps:
        spread = max(resume_bytes / (disk_gbps * 1e9), share / (HASH_GBPS * 1e9)) if verify else 0.0
    one_host = resume_bytes / (min(node_gbps, HASH_GBPS) * 1e9) if node_gbps else None
    convert = 2 * resume_bytes / (node_gbps * 1e9) if node_gbps else None
    return {
        "resume_bytes": resume_bytes,
        "share_bytes": int(share),
        "check_spread_s": spread,
        "check_one_host_s": one_host,
        "convert_s": convert,
        "verify": verify,
    }


__all__ = ["HASH_GBPS", "resume_times"]
