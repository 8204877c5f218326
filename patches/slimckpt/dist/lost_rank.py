"""A save whose collective lost a rank (killed, or stalled past the process group's timeout): one
line naming the rank, the step and what to do. Which rank is lost is slimckpt.dist.heartbeat's (its
heartbeat finds it, its `LOST` remembers it); this module says it in a save's words."""

from __future__ import annotations

from slimckpt import SlimckptError
from slimckpt.dist import heartbeat
from slimckpt.dist.heartbeat import in_a_job, lost_ranks_line


class RankLost(SlimckptError, RuntimeError):
    """A save's collective lost a rank; str() is the one-line message."""


def _line(lost: str, local_path: str, step: int) -> str:
    return (
        f"slimckpt: saving step {step} to {local_path} failed: {lost}; step {step} is not committed and "
        f"the tracker stays on the last committed step: restart the job (resume_mode=auto resumes from it)"
    )


def peer_loss_line(exc: BaseException, local_path: str, step: int) -> str | None:
    """The line for a save that lost a rank; None for any other failure. A loss found in a job of
    several processes is remembered (`heartbeat.LOST`) for `already_lost`."""
    lost = lost_ranks_line(exc)
    if lost is None:
        return None
    if in_a_job():
        heartbeat.LOST.remember(lost)
    return _line(lost, local_path, step)


def already_lost(local_path: str, step: int) -> str | None:
    """The line for a save begun after an earlier save of this process lost a rank (another role's
    background write, say), else None. Without it the save would make its group with the lost rank
    (a rendezvous that waits for the store's timeout) or wait in a collective for the group's."""
    if heartbeat.LOST.line is None:
        return None
    return _line(f"{heartbeat.LOST.line} (found by an earlier save of this job)", local_path, step)


__all__ = ["RankLost", "already_lost", "peer_loss_line"]
