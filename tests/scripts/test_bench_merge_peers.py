"""The same-box peers section: its floor, its table and what it says of a merge killed halfway (no runs)."""

from __future__ import annotations

import json

import pytest

from scripts.bench import merge_peers as mp
from scripts.bench import peers_save

GB = 10**9


def _disk() -> dict:
    return {"write_bytes_per_s": 2.0 * GB, "read_bytes_per_s": 1.0 * GB, "size_bytes": 2**30}


def _killed(**over) -> dict:
    found = {
        "kill_after_s": 10.0,
        "finished_first": False,
        "dirs": ["merged"],
        "files": ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"],
        "bytes": 4 * GB,
        "target_exists": True,
        "index": False,
        "manifest": False,
        "headers_ok": True,
    }
    return {**found, **over}


def _result() -> dict:
    row = {
        "tool": mp.DCP,
        "walls": [30.0, 20.0, 25.0],
        "peaks": [100 * 2**20, 300 * 2**20, 200 * 2**20],
        "loads": [1.0, 2.0, 3.0],
        "read_bytes": 8 * GB,
        "written_bytes": 8 * GB,
        "check": {"tensors": 255, "unequal": 0, "ok": True},
        "killed": _killed(),
    }
    return {
        "command": "python -m scripts.bench.merge_peers",
        "commit": "abc1234",
        "date": "2026-12-05 12:00 UTC",
        "seconds": 600.0,
        "machine": "x86_64, 2 cores",
        "load_start": 1.0,
        "load_end": 2.0,
        "preset": "llama3-8b",
        "world_size": 8,
        "dcp_preset": "llama3.2-3b",
        "inputs": {"dcp": {"command": "torchrun x", "bytes": 8 * GB, "save_s": 12.0}},
        "rows": [row, {"tool": mp.TC, "error": "AssertionError: Torch not compiled with CUDA enabled"}],
        "disk": _disk(),
    }


def test_the_floor_reads_the_input_and_writes_the_output_at_the_disks_speeds():
    assert mp.floor_s(_disk(), 8 * GB, 8 * GB) == 12.0


def test_a_row_is_its_median_over_its_floor_and_a_tool_that_cannot_run_says_why():
    text = mp.table(_result())
    assert "| 3 | 300 MiB | 25.0 s | 20.0-30.0 s | 12.0 s | 2.08x | 255 tensors equal |" in text
    assert "could not run: AssertionError: Torch not compiled with CUDA enabled" in text


def test_a_kill_halfway_that_leaves_whole_files_without_an_index_is_not_called_complete():
    assert "does not look complete" in mp.killed_words(_killed())
    assert "**looks complete**" in mp.killed_words(_killed(index=True))
    assert "finished before 10 s" == mp.killed_words(_killed(finished_first=True))
    assert mp.killed_words(_killed(files=[], dirs=[])) == "killed at 10 s: nothing"


def test_the_section_renders_from_its_json():
    result = json.loads(json.dumps(_result()))
    text = mp.render(result)
    assert text.startswith(mp.BEGIN) and text.endswith(mp.END)
    assert "commit abc1234" in text and "torch-checkpointing 0.1.1 could not save" not in text


def test_headers_ok_wants_whole_sized_safetensors(tmp_path):
    header = json.dumps({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    whole = tmp_path / "a.safetensors"
    whole.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    assert mp._headers_ok([whole])
    whole.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 2)
    assert not mp._headers_ok([whole])


def test_every_tool_splits_the_model_into_the_same_files():
    names = [f"w{k}" for k in range(10)]
    index = peers_save.hf_file_index(names, files=4)
    assert [index[n] for n in names] == [1, 1, 1, 2, 2, 2, 3, 3, 3, 4]


def test_another_runs_rows_join_the_table_with_their_own_floor_and_input():
    other = _result()
    other["rows"] = [dict(other["rows"][0], tool=mp.SINGLE)]
    other["inputs"] = {"verl": {"bytes": 8 * GB}}
    other["preset"], other["world_size"] = "llama3.2-3b", 2
    other["disk"] = {**_disk(), "read_bytes_per_s": 2.0 * GB}
    result = mp.add_run(_result(), other, "same size")
    text = mp.table(result)
    assert f"| {mp.SINGLE} (same size) | verl's rank files, llama3.2-3b at world size 2" in text
    assert "| 8.0 s | 3.12x |" in text


def test_an_incremental_steps_row_names_its_input_and_merges_with_slimckpt_merge(tmp_path):
    result = _result()
    result["rows"].insert(1, dict(result["rows"][0], tool=mp.INCR))
    result["inputs"]["slimckpt-incremental"] = {"command": "torchrun y", "bytes": 7.2 * GB, "save_s": 30.0}
    text = mp.render(json.loads(json.dumps(result)))
    assert (
        f"| {mp.INCR} | slimckpt incremental step (DCP files), llama3.2-3b at world size 2, real save, 7.2 GB | 3 |"
        in text
    )
    assert f"| {mp.DCP} | DCP HF shards, llama3.2-3b at world size 2, real save, 8.0 GB |" in text
    assert "- slimckpt-incremental input written by `torchrun y` in 30 s" in text
    step = tmp_path / "global_step_1" / "actor"
    assert mp.merge_commands(mp.INCR, step, tmp_path / "out") == mp.merge_commands(mp.SINGLE, step, tmp_path / "out")
    assert peers_save.incremental_role_dir(tmp_path) == str(step)


def test_the_tools_are_parsed_and_a_misspelt_one_is_refused():
    assert mp.parse_tools(" verl,slimckpt-incremental ,") == ["verl", "slimckpt-incremental"]
    assert "slimckpt-incremental" in mp.parse_tools(",".join(mp.TOOLS))
    assert "slimckpt-incremental" in peers_save.TOOLS
    with pytest.raises(SystemExit, match="unknown slimckpt-incr; pick from verl,dcp"):
        mp.parse_tools("verl,slimckpt-incr")


@pytest.mark.parametrize("name", ["bench_peers.json", "bench_peers_quiet.json", "bench_peers_3.6b.json"])
def test_the_committed_runs_still_render(name):
    path = mp.REPO / "docs" / name
    if not path.exists():
        pytest.skip(f"no {path}")
    text = mp.render(json.loads(path.read_text()))
    assert text.startswith(mp.BEGIN) and text.endswith(mp.END) and "| slimckpt merge |" in text
