"""merge/distributed: every rank's error line written before the ranks meet (torchrun ends the ranks still
running once one exits with an error). The distributed merges of real checkpoints: tests/merge/test_verl_merger.py
(slow)."""

from __future__ import annotations


def test_a_distributed_error_line_is_written_before_the_ranks_meet(capsys):
    """Each rank writes its error line, then waits for the others' (torchrun ends the ranks still
    running once one exits with an error); a peer that never reports costs the wait, not a hang."""
    import threading

    import torch.distributed as dist

    from slimckpt.hf.plan import MergeError
    from slimckpt.merge import distributed

    store = dist.HashStore()
    exc = MergeError("bad config")
    peer = threading.Timer(0.2, lambda: store.add(distributed.REPORTED_KEY, 1))
    peer.start()
    distributed.report_together(exc, store, world=2, wait_s=60.0)
    peer.join()
    assert store.add(distributed.REPORTED_KEY, 0) == 2 and exc.reported
    assert capsys.readouterr().err == "slimckpt merge: error: bad config\n"
    alone = MergeError("lost")
    distributed.report_together(alone, dist.HashStore(), world=2, wait_s=0.1)  # nobody else reports: returns
    assert alone.reported
