"""merge/distributed: `slimckpt merge --distributed_merge` outside torchrun refused in one line, ranks that do
not all join ending in seconds with the missing ones named, and every rank's error line written before the
ranks meet. The distributed merges of real checkpoints: tests/merge/test_verl_merger.py (slow)."""

from __future__ import annotations

import pytest

from ..helpers.merge_cli import (
    error_line,
    log_lines,
    merge_cli,
    ws2_checkpoint,
)
from ..helpers.merge_helpers import (
    run_cli,
)

slim_log = pytest.fixture(autouse=True, name="slim_log")(log_lines)
ckpt = pytest.fixture(scope="module", name="ckpt")(ws2_checkpoint)


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


def test_distributed_flag_outside_torchrun(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    rc, err = merge_cli(capsys, "--local_dir", str(ckpt), "--target_dir", str(tmp_path / "o"), "--distributed_merge")
    assert rc == 1 and "start it with torchrun" in error_line(err)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "rank, says",
    [
        ("0", "rank(s) 1 of 2 did not join within 3 s (this is rank 0)"),  # rank 1 never started
        ("1", "rank 1 of 2 could not reach rank 0's store at 127.0.0.1:"),  # rank 0 never started
    ],
)
def test_a_distributed_merge_whose_ranks_do_not_all_join_ends_in_minutes(ckpt, tmp_path, rank, says):
    """init_process_group waited up to 4 hours for a missing rank; now the join has
    SLIMCKPT_MERGE_JOIN_TIMEOUT seconds (600 by default) and the error names who is missing."""
    env = {
        "RANK": rank,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "SLIMCKPT_MERGE_JOIN_TIMEOUT": "3",
    }
    for k in ("TORCHELASTIC_USE_AGENT_STORE", "LOCAL_RANK"):
        env[k] = ""
    proc = run_cli(
        [
            "merge",
            "--distributed_merge",
            "--no_progress",
            "--local_dir",
            str(ckpt),
            "--target_dir",
            str(tmp_path / "o"),
        ],
        env=env,
        # the join gives up after its 3 s plus the imports; 90 s fails a join that waits its default 600 s
        timeout=90,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert says in line and "SLIMCKPT_MERGE_JOIN_TIMEOUT=<seconds>" in line and "MASTER_ADDR:MASTER_PORT" in line, line
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
