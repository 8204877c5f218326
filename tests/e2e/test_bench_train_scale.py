"""scripts/bench/train_scale.py run end to end on the tiny preset: every tier saves through verl's real
manager under torchrun, the incremental tier's and verl's loads put back the shards the run scrambled,
and a run past its memory cap is reported killed with the phase it was in."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ..conftest import REPO

pytestmark = pytest.mark.slow


def _bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "t.json"
    cmd = [sys.executable, "-m", "scripts.bench.train_scale", "--preset", "tiny", "--repeats", "1"]
    cmd += ["--out", "", "--readme", "", "--json", str(out), "--min-free-gib", "0.1", "--work", str(tmp_path / "w")]
    # every tier saved and loaded under torchrun: ~110 s on a loaded host; 600 s is a hang
    proc = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_tier_saves_and_both_loads_restore_the_shards(tmp_path):
    result = _bench(tmp_path, "--resume-ref", "")
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"verl", "intermediate", "incremental", "stream", "verl-resume"}
    assert not any(r["killed"] for r in rows.values())
    for mode in ("verl", "intermediate", "incremental", "stream"):
        assert rows[mode]["hf_safetensors"] >= 1, mode
        assert {"built", "save-1", "saved-1"} <= set(rows[mode]["events"])
    for mode in ("incremental", "verl-resume"):
        load = rows[mode]["load"]
        assert load["equal"], mode  # the scrambled shards were put back exactly
        assert {"load", "loaded"} <= set(rows[mode]["events"])
    assert "load" not in rows["stream"] and "load" not in rows["intermediate"]
    assert list(tmp_path.joinpath("w").iterdir()) == []  # every run's dir removed


def test_a_run_over_its_cap_is_reported_killed_where_it_was(tmp_path):
    result = _bench(tmp_path, "--resume-ref", "", "--modes", "verl", "--cap-gib", "0.3")
    assert [r["mode"] for r in result["rows"]] == ["verl", "verl-resume"]
    for row in result["rows"]:
        assert row["killed"] and row["killed_by"] == "the cap"
        assert row["killed_in"] == "start-up"  # two ranks importing verl pass 0.3 GiB before any save
        assert row["tree_peak"] > 0.3 * 2**30
    import psutil

    procs = psutil.process_iter(["cmdline"])  # a zombie's or a vanished process's cmdline comes back None
    left = [p.info["cmdline"] for p in procs if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert left == []  # no rank outlives its killed launcher
