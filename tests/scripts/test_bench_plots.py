"""scripts.bench.plots: the pictures of the committed bench results (merge up to 8B, save peak memory, the\njob's memory over one 3.6B save)."""

from __future__ import annotations

import json
import shutil

from scripts.bench import plots

from ..conftest import REPO

DOCS = REPO / "docs"


def test_the_merge_points_span_the_bench_and_the_scale_run():
    merge = json.loads((DOCS / "bench_merge.json").read_text())
    scale = json.loads((DOCS / "bench_scale.json").read_text())
    pts = plots.merge_points(merge, scale)
    ours, verl = pts["slimckpt merge"], pts["verl 0.9.1 merger"]
    dense = {r["size"] for r in merge["rows"] if not r["size"].startswith("moe")}
    assert len(ours) == len(dense) + 1 and len(verl) == len(dense)  # 8B: verl was killed, no wall
    assert ours[-1][0] == scale["build"]["params"] / 1e9
    assert all(a[0] < b[0] for a, b in zip(ours, ours[1:]))
    assert all(wall > floor > 0 for _, _, wall, floor in ours)


def test_the_pictures_are_drawn_from_the_committed_json(tmp_path):
    for name in ("bench_merge.json", "bench_scale.json", "bench_save.json", "bench_train_scale.json"):
        shutil.copy(DOCS / name, tmp_path / name)
    plots.main(["--docs", str(tmp_path)])
    for name in ("merge_scale.png", "save_peak_memory.png", "save_rss_timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
