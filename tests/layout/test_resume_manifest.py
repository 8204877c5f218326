"""layout/resume_manifest: the incremental tier's manifest, read and shared between ranks."""

from __future__ import annotations

import slimckpt.layout.resume_manifest as rm


def test_load_check_shares_bytes_evenly_across_ranks():
    # two big rank shards must go to different ranks, whatever their order in the manifest
    assert rm.share_by_bytes([100, 5, 3, 1, 100, 3], 2) == [0, 0, 1, 0, 1, 1]
    sizes = [100, 5, 3, 1, 100, 3]
    owner = rm.share_by_bytes(sizes, 2)
    per_rank = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(2)]
    assert max(per_rank) - min(per_rank) <= 5
    assert rm.share_by_bytes([7], 4) == [0]
