"""host_memory_budget_gb: a number of GiB, or `auto`, derived from the node this rank runs on.

`auto` is a share of the node's available memory divided by the ranks on the node:

    budget per rank = AUTO_SHARE x available / local ranks

available: MemAvailable of /proc/meminfo, lowered to what the process's cgroup still allows (a
container's memory.max); local ranks: LOCAL_WORLD_SIZE, which torchrun and verl's Ray workers set
for every rank. A rank resolves it once, when its first save needs it: by then the model, the
optimizer and verl's offloaded host copies exist, so they count as used; what grows later (the
rollout's buffers, Ray's object store, parameters offloaded again after the save, the other role
on the same ranks) is what the other half is left for. A pool's ranks then agree on the smallest
budget (resume_async), so that every rank of one save takes the same path.

An explicit number always wins and is used as given. The arithmetic is pure (`auto_budget_bytes`,
also used by `slimckpt plan`); reading the node is `node_available_bytes` / `local_ranks`.
"""

from __future__ import annotations

from typing import Any

from slimckpt import env_vars
from slimckpt.log import get_logger

log = get_logger("slimckpt.resume")

AUTO = "auto"
# half the node: the other half is for what a run's host memory does after the first save
AUTO_SHARE = 0.5
CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)

_resolved: dict[str, int] = {}


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def auto_budget_bytes(available_bytes: int, local_ranks: int, share: float = AUTO_SHARE) -> int:
    """Each rank's share of `available_bytes` on a node with `local_ranks` ranks."""
    return int(max(0, int(available_bytes)) * share) // max(1, int(local_ranks))


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    for limit_path, usage_path in CGROUP_FILES:
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        # "max" (v2) or a page-rounded 2^63 (v1): no limit
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - usage)
    return None


def node_available_bytes() -> int:
    """What this node can still give: MemAvailable, within the cgroup's limit if it has one."""
    found = [v for v in (_meminfo_available(), _cgroup_room()) if v is not None]
    if not found:
        raise RuntimeError(
            "slimckpt: host_memory_budget_gb=auto cannot read /proc/meminfo; set "
            "actor_rollout_ref.actor.checkpoint.host_memory_budget_gb=<GiB> (and critic's)"
        )
    return min(found)


def local_ranks() -> int:
    """Ranks on this node (LOCAL_WORLD_SIZE; 1 where nothing set it)."""
    try:
        return max(1, int(env_vars.foreign("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def budget_bytes(config: Any) -> int:
    """The config's host_memory_budget_gb in bytes; `auto` resolved on first use in this process
    (and logged once, by the node's first rank)."""
    value = config.host_memory_budget_gb
    if not is_auto(value):
        return int(float(value) * 2**30)
    if AUTO not in _resolved:
        available, ranks = node_available_bytes(), local_ranks()
        _resolved[AUTO] = auto_budget_bytes(available, ranks)
        if env_vars.foreign("LOCAL_RANK", "0") == "0":
            log.info(
                "host_memory_budget_gb=auto: %.2f GiB per rank (%g of the %.1f GiB available on this node, "
                "over %d local ranks); set a number of GiB to override",
                _resolved[AUTO] / 2**30,
                AUTO_SHARE,
                available / 2**30,
                ranks,
            )
    return _resolved[AUTO]


def reset() -> None:
    """Forget the resolved `auto` (tests; a process that moved to other hardware has none)."""
    _resolved.clear()
