"""scripts.bench.headline: README's measured rows come from the committed bench JSON and nowhere else."""

from __future__ import annotations

import json

import pytest

from scripts.bench import headline

from ..conftest import REPO


def test_readme_holds_what_the_committed_json_renders():
    text = (REPO / "README.md").read_text()
    begin, end = text.index(headline.BEGIN), text.index(headline.END) + len(headline.END)
    assert text[begin:end] + "\n" == headline.block(*headline.load(REPO / "docs"))


def test_the_best_peer_is_the_fastest_other_tool_that_ran_and_matched():
    peers = {
        "rows": [
            {"tool": "slimckpt merge", "walls": [1.0], "peaks": [1]},
            {"tool": "slow", "walls": [9.0, 8.0, 7.0], "peaks": [1], "check": {"ok": True}},
            {"tool": "fast but wrong", "walls": [1.0], "peaks": [1], "check": {"ok": False}},
            {"tool": "fast", "walls": [3.0, 2.0, 4.0], "peaks": [1], "check": {"ok": True}},
            {"tool": "did not run", "error": "AssertionError"},
        ]
    }
    assert headline.best_peer(peers)["tool"] == "fast"
    assert headline.best_peer({"rows": peers["rows"][:1]}) is None


def test_a_missing_row_ends_in_one_line(tmp_path):
    for name in ("bench_save.json", "bench_merge.json", "bench_peers.json", "bench_peers_3.6b.json"):
        (tmp_path / name).write_text((REPO / "docs" / name).read_text())
    save = json.loads((tmp_path / "bench_save.json").read_text())
    save["rows"] = [r for r in save["rows"] if r["mode"] != "verl"]
    (tmp_path / "bench_save.json").write_text(json.dumps(save))
    with pytest.raises(SystemExit, match="no row .* in the bench JSON"):
        headline.main(["--docs", str(tmp_path), "--readme", ""])


def test_it_refuses_a_readme_without_its_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n")
    with pytest.raises(SystemExit, match="has no <!-- bench-headline:begin -->"):
        headline.main(["--readme", str(readme)])
