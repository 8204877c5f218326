"""Environment faults: a full disk, a read-only or unwritable directory, two writers on one target give one
clear line, fail or continue as configured, and leave nothing that looks committed. Here: two merges on one
target, and scripts/faults/env.py through verl's manager; a save's side in tests/save/test_errors.py, the
locks' in tests/storage/test_locks.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from slimckpt.storage import locks
from tests.helpers.launch import REPO

# --------------------------------------------------------------------------- merge


def test_two_merges_into_one_target(tmp_path):
    from slimckpt.merge.pipeline import merge
    from slimckpt.merge.plan import MergeError, MergeOptions
    from slimckpt_testing.synthetic import synthetic_checkpoint

    src = synthetic_checkpoint(tmp_path / "global_step_1" / "actor")
    target = str(tmp_path / "out")
    with locks.writing(target, "merging x into it", fix=""):
        with pytest.raises(MergeError) as err:
            merge(MergeOptions(local_dir=str(src), target_dir=target, progress=False))
    assert "merging x into it" in str(err.value) and "--target_dir" in str(err.value)
    assert not os.path.exists(target) and not os.path.exists(target + ".partial")


def test_merge_refuses_a_step_being_written(tmp_path):
    from slimckpt.merge.pipeline import merge
    from slimckpt.merge.plan import MergeError, MergeOptions
    from slimckpt_testing.synthetic import synthetic_checkpoint

    src = synthetic_checkpoint(tmp_path / "global_step_1" / "actor")
    with locks.writing(str(src), "saving step 1", fix=""):
        with pytest.raises(MergeError, match="saving step 1"):
            merge(MergeOptions(local_dir=str(src), target_dir=str(tmp_path / "out"), progress=False))


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_env_faults_script_through_verls_manager(tmp_path):
    """scripts/faults/env.py through verl's real FSDPCheckpointManager: the synchronous incremental
    save (stop) and quickstart with on_save_error=continue, under a file size limit and a held lock."""
    out = tmp_path / "faults.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.faults.env",
            "--json",
            str(out),
            "--paths",
            "incremental_sync,quickstart_continue",
            "--faults",
            "fsize_limit,lock,export_full",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        # 5 faulted saves through verl's manager (~60 s on a loaded host); 300 s is a hang
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(r["path"], r["fault"]): r for r in report["rows"]}
    assert len(rows) == 5 and ("quickstart_continue", "export_full") not in rows  # quickstart exports nothing
    full = rows.pop(("incremental_sync", "export_full"))
    if report["env"]["can_mount"]:  # the recipe as shipped exports: the disk fills inside the export
        assert full["verdict"] == "ok" and full["exit"] == "raised", full
        assert "huggingface" in full["message"] and "trainer.default_local_dir" in full["message"], full
        assert "--target_dir" not in full["message"], full
    for r in rows.values():
        assert r["failed"] and not r["looks_committed"] and not r["tracker_moved"], r
        assert r["one_line"] and r["names_path"], r
    assert rows[("incremental_sync", "fsize_limit")]["exit"] == "raised"
    assert "File too large" in rows[("incremental_sync", "fsize_limit")]["message"]
    assert rows[("quickstart_continue", "fsize_limit")]["exit"] == "continued"  # training goes on
    assert rows[("quickstart_continue", "lock")]["exit"] == "raised"  # a lock conflict always stops
