"""A save whose collective lost a rank (killed, or stalled past the process group's timeout): one
line naming the rank (slimckpt.dist.heartbeat finds it by its heartbeat), the step and what to do."""

from __future__ import annotations

from slimckpt import SlimckptError
from slimckpt.dist.heartbeat import in_a_job, lost_ranks_line


class RankLost(SlimckptError, RuntimeError):
    """A save's collective lost a rank; str() is the one-line message."""


# what this process found lost, once one of its saves failed on it: the job's groups are broken for
# good, so later saves fail at once instead of making (or using) a collective with the lost rank
_LOST: list[str] = []


def _line(lost: str, local_path: str, step: int) -> str:
    return (
        f"slimckpt: saving step {step} to {local_path} failed: {lost}; step {step} is not committed and "
        f"the tracker stays on the last committed step: restart the job (resume_mode=auto resumes from it)"
    )


def peer_loss_line(exc: BaseException, local_path: str, step: int) -> str | None:
    """The line for a save that lost a rank; None for any other failure. A loss found in a job of
    several processes is remembered for `already_lost`."""
    lost = lost_ranks_line(exc)
    if lost is None:
        return None
    if not _LOST and in_a_job():
        _LOST.append(lost)
    return _line(lost, local_path, step)


def already_lost(local_path: str, step: int) -> str | None:
    """The line for a save begun after an earlier save of this process lost a rank (another role's
    background write, say), else None. Without it the save would make its group with the lost rank
    (a rendezvous that waits for the store's timeout) or wait in a collective for the group's."""
    if not _LOST:
        return None
    return _line(f"{_LOST[0]} (found by an earlier save of this job)", local_path, step)


__all__ = ["RankLost", "already_lost", "peer_loss_line"]
