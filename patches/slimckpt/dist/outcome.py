"""One outcome for every rank: run a step, gather what failed where, raise the same error everywhere.

A collective save, load or merge must not end with one rank raising and the others waiting in the
next collective until the process group's timeout. Every path that can fail on some ranks only
goes through one of three shapes here:

  - `on_every_rank`: each rank runs its part; if any failed, every rank raises the first failure;
  - `from_rank0`: rank 0 runs the part (plan, lock, commit) and every rank gets its value, or
    the same error;
  - `agree`: the ranks already hold their outcome (a recorded failure, a damage report); they
    exchange it and raise together.

The failure that travels is a `Failure`: a one-line message, the rank, and the errno of the OS
error under it, so every rank's error names the same fix and `raise ... from OSError(...)` keeps
the cause for callers that describe OS errors. With no process group (one process, tests) the
step runs alone and its error is raised as the same type.
"""

# lazy imports: torch.distributed only when a group is active (the torch-free merge CLI imports this module)
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Failure:
    """What failed on one rank: picklable, so it crosses the group as an object."""

    rank: int
    line: str
    os_error: tuple[int, str, str | None] | None = None  # errno, strerror, filename
    kind: str = ""  # lets a caller pick its exception type (e.g. "busy" for a lock held elsewhere)
    args: tuple = ()  # what a caller rebuilds its own exception from on every rank (picklable values)
    order: int = 0  # callers that rank failures (the first damaged file, not the lowest rank) set it

    def cause(self) -> OSError | None:
        return OSError(*self.os_error) if self.os_error else None


def _os_error_of(exc: BaseException) -> tuple[int, str, str | None] | None:
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno, exc.strerror or "", exc.filename
    return None


def failure_of(
    exc: BaseException, rank: int, describe: Callable[[BaseException], str] = str, kind: str = "", order: int = 0
) -> Failure:
    """A rank's exception as a Failure; `describe` turns it into the one line users read."""
    return Failure(rank, describe(exc), _os_error_of(exc), kind, order)


ErrorFactory = Callable[[Failure], BaseException]


def _dist():
    import torch.distributed as dist

    return dist


def _active(group: Any) -> bool:
    try:
        dist = _dist()
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized()


def _rank(group: Any) -> int:
    return _dist().get_rank(group) if _active(group) else 0


def first(failures: Sequence[Failure | None]) -> Failure | None:
    """The failure every rank raises: the lowest `order`, then the lowest rank."""
    found = [f for f in failures if f is not None]
    return min(found, key=lambda f: (f.order, f.rank)) if found else None


def gather(group: Any, mine: Failure | None) -> list[Failure | None]:
    """Every rank's failure (None where it had none), in rank order; [mine] without a group."""
    if not _active(group):
        return [mine]
    dist = _dist()
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, mine, group=group)
    return found


def raise_failure(failure: Failure | None, error: ErrorFactory) -> None:
    if failure is not None:
        raise error(failure) from failure.cause()


def agree(group: Any, mine: Failure | None, error: ErrorFactory) -> None:
    """Exchange the ranks' outcomes; every rank raises `error(first failure)` if any failed."""
    raise_failure(first(gather(group, mine)), error)


def on_every_rank(
    group: Any,
    step: Callable[[], T],
    error: ErrorFactory,
    describe: Callable[[BaseException], str] = str,
    catch: tuple[type[BaseException], ...] = (Exception,),
    kind_of: Callable[[BaseException], str] = lambda exc: "",
) -> T:
    """Each rank runs `step`; if it raised on any rank, every rank raises `error(first failure)`."""
    rank = _rank(group)
    value: Any = None
    mine: Failure | None = None
    try:
        value = step()
    except catch as exc:  # every rank must hear about it
        mine = failure_of(exc, rank, describe, kind_of(exc))
    agree(group, mine, error)
    return value


def from_rank0(
    group: Any,
    step: Callable[[], T],
    error: ErrorFactory,
    describe: Callable[[BaseException], str] = str,
    catch: tuple[type[BaseException], ...] = (Exception,),
    kind_of: Callable[[BaseException], str] = lambda exc: "",
) -> T:
    """Rank 0 of `group` runs `step`; every rank returns its (picklable) value or raises the same error."""
    rank = _rank(group)
    box: list[Any] = [None]
    if rank == 0:
        try:
            box = [("ok", step())]
        except catch as exc:  # every rank must hear about it
            box = [("error", failure_of(exc, 0, describe, kind_of(exc)))]
    if _active(group):
        dist = _dist()
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    state, payload = box[0]
    if state == "error":
        raise_failure(payload, error)
    return payload


__all__ = [
    "ErrorFactory",
    "Failure",
    "agree",
    "failure_of",
    "first",
    "from_rank0",
    "gather",
    "on_every_rank",
    "raise_failure",
]
