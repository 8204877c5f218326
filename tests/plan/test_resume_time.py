"""plan/resume_time: the check at resume and the conversion, timed for the incremental rows."""

from __future__ import annotations

import io
import json

import pytest

from slimckpt.plan import build, printers

from .conftest import TINY
from .conftest import plan_args as _args


def test_resume_check_and_convert_are_timed_for_incremental_rows(tmp_path):
    from slimckpt.plan.resume_time import HASH_GBPS, resume_times

    t = resume_times(800 * 10**9, 32, 10.0, 2.5)
    assert t["check_spread_s"] == pytest.approx(80.0)  # read once at the aggregate bandwidth
    assert t["check_one_host_s"] == pytest.approx(320.0)  # what one host reading it all would take
    assert t["convert_s"] == pytest.approx(640.0)  # read + write on one host
    # a fast store: the ranks' hashing bounds it, each its share
    assert resume_times(800 * 10**9, 2, 1000.0, 500.0)["check_spread_s"] == pytest.approx(400 / HASH_GBPS)
    assert resume_times(10, 1, None, None)["check_spread_s"] is None

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    r = build.build_report(_args(cfg, disk_gbps=10.0))
    rows = {e["strategy"]: e.get("resume_times") for e in r["estimates"]}
    assert rows["verl default"] is None and rows["+recipe=incremental"]["resume_bytes"] > 0
    out = io.StringIO()
    printers.print_report(r, out)
    assert "slimckpt convert --to verl" in out.getvalue() and "check at resume" in out.getvalue()
