"""A save whose collective lost a rank (killed, or stalled past the process group's timeout): one
line naming the rank (slimckpt.write.peers finds it by its heartbeat), the step and what to do."""

from __future__ import annotations

from ..write.peers import lost_ranks_line


class RankLost(RuntimeError):
    """A save's collective lost a rank; str() is the one-line message."""


def peer_loss_line(exc: BaseException, local_path: str, step: int) -> str | None:
    """The line for a save that lost a rank; None for any other failure."""
    lost = lost_ranks_line(exc)
    if lost is None:
        return None
    return (
        f"slimckpt: saving step {step} to {local_path} failed: {lost}; step {step} is not committed and "
        f"the tracker stays on the last committed step: restart the job (resume_mode=auto resumes from it)"
    )


__all__ = ["RankLost", "peer_loss_line"]
