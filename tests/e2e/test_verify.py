"""slimckpt verify on real checkpoints: a small corruption campaign (scripts/faults/corruption.py), every damage
flagged and named, the load check refusing each incremental one with verify's line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..conftest import REPO


@pytest.mark.slow
def test_small_campaign_detects_every_corruption(tmp_path):
    """20 corruptions of a real merge output and a real incremental save (plus 7 of a verl-native
    one, reported apart): verify flags and names every one on slimckpt's formats, and the load
    check refuses each incremental one with verify's own line. The undamaged sources verify clean."""
    out = tmp_path / "c.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.faults.corruption",
            "--trials",
            "20",
            "--native_trials",
            "7",
            "--no_real_load",
            "--seed",
            "3",
            "--json",
            str(out),
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        # the campaign makes real checkpoints and damages them 27 times (~50 s loaded); 400 s is a hang
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    s = r["slimckpt"]
    assert s["trials"] == 20 and s["detected"] == 20 and s["named_right_file"] == 20, r["missed"]
    assert s["load_refused_same_message"] == s["load_trials"] == 10
    assert r["clean_sources_ok"] == ["incremental", "merge", "native"]
    assert r["native"]["trials"] == 7
