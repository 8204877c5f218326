"""What async_save=stream costs training: blocked time as a function of the rollout window.

Pure arithmetic, for `slimckpt plan` (no torch). A stream save returns after capturing references
(milliseconds); the background writer then reads the rank's `shard_bytes` over `write_s` seconds.
The next change to the shards (the optimizer step of the next step) arrives `window_s` after the
save returned (the rollout, reward and reference passes). Its guard copies what the writer has not
released yet, up to `budget_bytes` (host_memory_budget_gb), and waits for the rest.

Approximation: the writer releases the captured bytes evenly over the write, so at the guard
`pending = shard_bytes x (1 - window_s / write_s)` are still unread (the HF export reads the
model a second time after the DCP shards; spreading both evenly is what makes this an estimate).
Then:
    window_s >= write_s                      no block, no copy
    pending <= budget_bytes                  copy `pending` (a host copy, no disk), no wait
    otherwise                                copy budget_bytes, wait (pending - budget) / rate,
                                             rate = shard_bytes / write_s

With verl's offload (`offloaded_bytes`: the part of the shard param_offload / optimizer_offload move
to the host between updates) the write reads that part from the host copies the offload makes: the
guard neither copies nor waits for it; the unread share of it (`kept_bytes`, pending in proportion)
stays alive past the reload, in place of being freed. The guard works on the rest as above.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamBlock:
    window_s: float
    pending_bytes: int  # captured bytes the writer has not released when the guard runs
    copied_bytes: int  # what the guard copies into host memory (within the budget)
    wait_s: float  # what it waits for the writer (disk bound)
    copy_s: float | None  # the copy at copy_gbps (None when no bandwidth was given)
    kept_bytes: int = 0  # unread host copies of an offload that the reload leaves to the writer

    @property
    def blocked_s(self) -> float | None:
        return None if self.copy_s is None else self.wait_s + self.copy_s


def stream_block(
    shard_bytes: int,
    write_s: float,
    window_s: float,
    budget_bytes: int,
    copy_gbps: float | None = None,
    offloaded_bytes: int = 0,
) -> StreamBlock:
    """The guard of the next optimizer step, `window_s` after a stream save returned."""
    if shard_bytes <= 0 or write_s <= 0 or window_s >= write_s:
        return StreamBlock(window_s, 0, 0, 0.0, 0.0 if copy_gbps else None)
    pending = int(shard_bytes * (1.0 - max(0.0, window_s) / write_s))
    kept = int(pending * min(1.0, max(0, offloaded_bytes) / shard_bytes))
    copied = min(pending - kept, max(0, int(budget_bytes)))
    wait = (pending - kept - copied) * write_s / shard_bytes
    copy_s = copied / (copy_gbps * 1e9) if copy_gbps else None
    return StreamBlock(window_s, pending, copied, wait, copy_s, kept)


def windows_for(write_s: float, given: list[float] | None) -> list[float]:
    """The rollout windows to show: the ones given, else 0, a quarter, half and all of the write
    and twice it."""
    if given:
        return sorted(given)
    return [0.0, write_s / 4, write_s / 2, write_s, 2 * write_s]
