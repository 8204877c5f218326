"""verify/command: each detection on small synthetic dirs of slimckpt's formats (fast, no torchrun), the CLI's
lines and exit codes, the load check's message equal to verify's line. verl's own dirs: test_native.py; a
corruption campaign on real checkpoints: tests/e2e/test_verify.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import slimckpt.engine.output_dir as od
import slimckpt.engine.resume_records as rr
import slimckpt.layout.merge_manifest as mm
import slimckpt.layout.resume_manifest as rm
from slimckpt import cli
from slimckpt.verify.command import KIND_INCREMENTAL, KIND_MERGE, detect, verify_path

from ..conftest import REPO
from .conftest import flip as _flip
from .conftest import lines


def _write(path, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def merge_dir(tmp_path, name="out"):
    partial = od.prepare_partial(str(tmp_path / name))
    for rel, data in {
        "model-00001-of-00002.safetensors": b"a" * 300,
        "model-00002-of-00002.safetensors": b"b" * 300,
        "config.json": b'{"model_type": "llama"}',
    }.items():
        _write(os.path.join(partial, rel), data)
    od.write_manifest(partial, mm.Manifest(kind="hf_export", files=mm.build_entries(partial), tool_version="t"))
    od.commit(partial, str(tmp_path / name))
    return tmp_path / name


def role_dir(tmp_path, step=3, role="actor", world=2):
    d = tmp_path / f"global_step_{step}" / role
    rels = []
    for r in range(world):
        _write(str(d / "dcp" / f"__{r}_0.distcp"), bytes([r]) * 200)
        _write(str(d / f"slimckpt_extra_world_size_{world}_rank_{r}.pt"), b"e" * 50)
        rels += [f"dcp/__{r}_0.distcp", f"slimckpt_extra_world_size_{world}_rank_{r}.pt"]
    _write(str(d / "dcp" / ".metadata"), b"m" * 40)
    _write(str(d / "huggingface" / "config.json"), b'{"model_type": "llama"}')
    rels += ["dcp/.metadata", "huggingface/config.json"]
    files = rm.describe_files(str(d), rels)
    rr.write_manifest(str(d), rm.Manifest(global_step=step, world_size=world, contents=["model"], files=files))
    return d


# --------------------------------------------------------------------------- merge outputs


@pytest.mark.parametrize(
    "damage,reason",
    [
        ("flip", "xxh3_128"),
        ("truncate", "size 299 bytes"),
        ("delete", "missing"),
        ("extra", "not in the manifest"),
        ("swap", "xxh3_128"),
    ],
)
def test_merge_output_damage_is_named(tmp_path, damage, reason):
    out = merge_dir(tmp_path)
    a, b = out / "model-00001-of-00002.safetensors", out / "model-00002-of-00002.safetensors"
    if damage == "flip":
        _flip(a, 17)
    elif damage == "truncate":
        os.truncate(a, 299)
    elif damage == "delete":
        a.unlink()
    elif damage == "extra":
        (out / "stray.bin").write_bytes(b"x")
    else:
        a.rename(out / "t")
        b.rename(a)
        (out / "t").rename(b)
    assert verify_path(str(tmp_path / "out")).ok is False
    report = verify_path(str(out))
    assert detect(str(out)) == KIND_MERGE
    named = {os.path.basename(p.file) for p in report.bad}
    assert ("stray.bin" if damage == "extra" else a.name) in named
    assert all(m.startswith("slimckpt: ") and "\n" not in m and "slimckpt merge" in m for m in lines(report))
    assert any(reason in m for m in lines(report))


def test_manifest_seal_catches_a_change_that_still_parses(tmp_path):
    out = merge_dir(tmp_path)
    path = out / mm.MANIFEST_NAME
    data = json.loads(path.read_text())
    config = next(f for f in data["files"] if f["path"] == "config.json")
    config["size"] += 0  # unchanged record: still whole
    path.write_text(json.dumps(data))
    assert verify_path(str(out)).ok
    config["checksum"] = "0" * 32  # valid JSON, wrong record
    path.write_text(json.dumps(data))
    report = verify_path(str(out))
    assert [os.path.basename(p.file) for p in report.bad] == [mm.MANIFEST_NAME]
    assert "manifest itself is damaged" in report.bad[0].reason


def test_merge_output_without_manifest_or_partial(tmp_path):
    out = merge_dir(tmp_path)
    (out / mm.MANIFEST_NAME).unlink()
    report = verify_path(str(out))
    assert [os.path.basename(p.file) for p in report.bad] == [mm.MANIFEST_NAME]
    part = tmp_path / "x.partial"
    shutil.copytree(out, part)
    assert "unfinished merge" in verify_path(str(part)).bad[0].reason


# --------------------------------------------------------------------------- incremental role dirs


@pytest.mark.parametrize(
    "damage",
    [
        "flip",
        "truncate",
        "delete",
        "swap",
        "extra_dcp",
        "extra_top",
        "marker",
        "manifest_flip",
        "manifest_truncate",
        "manifest_delete",
    ],
)
def test_incremental_damage_load_refuses_with_verify_line(tmp_path, damage):
    d = role_dir(tmp_path)
    a = d / "dcp" / "__0_0.distcp"
    if damage == "flip":
        _flip(a, 100)
    elif damage == "truncate":
        os.truncate(a, 10)
    elif damage == "delete":
        a.unlink()
    elif damage == "swap":
        a.rename(d / "t")
        (d / "dcp" / "__1_0.distcp").rename(a)
        (d / "t").rename(d / "dcp" / "__1_0.distcp")
    elif damage == "extra_dcp":
        (d / "dcp" / "__2_0.distcp").write_bytes(b"z")
    elif damage == "extra_top":
        (d / "notes.txt").write_text("x")
    elif damage == "marker":
        # a rank that failed after listing its files, before rank 0's manifest (write_failure keeps
        # out of a committed dir, so the note is written as that rank wrote it)
        (d / f"{rm.FAILED_PREFIX}1.txt").write_text("boom\n")
    elif damage == "manifest_flip":
        _flip(d / rm.MANIFEST_NAME, 60)
    elif damage == "manifest_truncate":
        os.truncate(d / rm.MANIFEST_NAME, 30)
    else:
        (d / rm.MANIFEST_NAME).unlink()
    report = verify_path(str(d))
    assert not report.ok and detect(str(d)) == KIND_INCREMENTAL
    with pytest.raises(rm.UncommittedCheckpoint) as info:
        rm.check_committed(str(d))
    assert str(info.value) in lines(report)  # the load's one line is verify's line
    assert "\n" not in str(info.value)


def test_incremental_clean_quick_and_stray_json_is_damage(tmp_path):
    d = role_dir(tmp_path)
    report = verify_path(str(d))
    assert report.ok
    rm.check_committed(str(d))
    _flip(d / "dcp" / "__1_0.distcp", 3)
    assert verify_path(str(d), quick=True).ok  # sizes only
    assert not verify_path(str(d)).ok
    d = role_dir(tmp_path, step=4)
    (d / "slimckpt_save_rank_0.json").write_text("{}")  # a file the manifest does not list
    assert "not listed" in verify_path(str(d)).bad[0].reason


# --------------------------------------------------------------------------- steps and roots


def test_root_checks_every_step_and_the_tracker(tmp_path):
    role_dir(tmp_path, step=1)
    role_dir(tmp_path, step=2)
    torch.save({"step": 2}, tmp_path / "global_step_2" / "data.pt")
    rr.write_tracker(str(tmp_path), 2)
    report = verify_path(str(tmp_path))
    assert report.ok, lines(report)
    assert {c["kind"] for c in report.checked} >= {"checkpoint root", "step", KIND_INCREMENTAL}

    _flip(tmp_path / "global_step_2" / "actor" / "dcp" / ".metadata", 0)
    bad = lines(verify_path(str(tmp_path)))
    assert any(".metadata" in m for m in bad)
    assert any(rm.TRACKER_NAME in m and "names step 2, which is damaged" in m and "echo 1 >" in m for m in bad)

    rr.atomic_write_text(str(tmp_path / rm.TRACKER_NAME), "7")
    assert any("names step 7, which does not exist" in m for m in lines(verify_path(str(tmp_path))))
    os.truncate(tmp_path / "global_step_2" / "data.pt", 20)
    assert any("data.pt" in m for m in lines(verify_path(str(tmp_path / "global_step_2"))))


def test_interrupted_step_is_named(tmp_path):
    (tmp_path / "global_step_5" / "actor" / "huggingface").mkdir(parents=True)
    (tmp_path / "global_step_5" / "actor" / "huggingface" / "config.json").write_text("{}")
    report = verify_path(str(tmp_path / "global_step_5"))
    assert not report.ok and "interrupted save" in report.bad[0].message


# --------------------------------------------------------------------------- CLI


def test_cli_exit_codes_and_lines(tmp_path, capsys):
    out = merge_dir(tmp_path)
    assert cli.main(["verify", str(out)]) == 0
    assert capsys.readouterr().out.startswith("OK: ")
    os.truncate(out / "config.json", 3)
    assert cli.main(["verify", str(out)]) == 1
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith(f"slimckpt: {out / 'config.json'}: size 3 bytes") and text[-1].startswith("BAD: ")
    assert cli.main(["verify", str(out), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["bad"][0]["file"] == str(out / "config.json")
    (tmp_path / "empty").mkdir()
    assert cli.main(["verify", str(tmp_path / "empty")]) == 2
    assert "not a checkpoint dir" in capsys.readouterr().err


def test_cli_help_lists_verify():
    proc = subprocess.run(  # --help imports the CLI and prints: seconds; 60 s is a hang
        [sys.executable, "-m", "slimckpt.cli", "verify", "--help"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert proc.returncode == 0 and "--quick" in proc.stdout and "--json" in proc.stdout


def test_lock_files_next_to_a_subdir_are_not_extras(tmp_path):
    d = role_dir(tmp_path)
    (d / ".huggingface.slimckpt-lock").write_text("pid 1 on host h: exporting")
    assert verify_path(str(d)).ok
    rm.check_committed(str(d))
