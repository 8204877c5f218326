"""One manifest schema: a merge output's manifest.json and an incremental step's slimckpt_resume.json
list their files as the same records ({path, size, checksum}), written by one put (engine/manifest_put);
manifests written before (a merge's files as a dict by path, format_version 1; a step's sizes spelled
`bytes`, slimckpt-resume/1) are still read, checked and verified. The fixtures under fixtures/old_manifests
were written by the code of that time."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import slimckpt.layout.merge_manifest as mm
import slimckpt.layout.resume_manifest as rm
from slimckpt.engine.output_dir import write_manifest
from slimckpt.engine.resume_records import commit_manifest
from slimckpt.verify.command import verify_path

OLD = Path(__file__).parent / "fixtures" / "old_manifests"
OLD_ROLE = Path("ckpt") / "global_step_3" / "actor"


@pytest.fixture
def old(tmp_path) -> Path:
    shutil.copytree(OLD, tmp_path / "old")
    return tmp_path / "old"


def test_old_fixtures_are_as_the_old_code_wrote_them():
    merge = json.loads((OLD / "merge_output" / mm.MANIFEST_NAME).read_text())
    assert merge["format_version"] == 1 and isinstance(merge["files"], dict)
    step = json.loads((OLD / OLD_ROLE / rm.MANIFEST_NAME).read_text())
    assert step["format"] == "slimckpt-resume/1" and all("bytes" in f and "size" not in f for f in step["files"])


def test_an_old_merge_manifest_is_read_and_verified(old):
    m = mm.read_manifest(str(old / "merge_output"))
    assert m.format_version == 1
    assert m.files["config.json"] == mm.FileEntry("config.json", 24, m.files["config.json"].checksum)
    assert mm.verify(str(old / "merge_output")) == []
    assert verify_path(str(old / "merge_output")).ok


def test_an_old_step_manifest_is_read_checked_and_verified(old):
    m = rm.check_committed(str(old / OLD_ROLE))
    assert [(e.path, e.size) for e in m.files] == [("dcp/__0_0.distcp", 64), ("huggingface/config.json", 24)]
    assert verify_path(str(old / "ckpt")).ok
    (old / OLD_ROLE / "dcp" / "__0_0.distcp").write_bytes(bytes(63))
    report = verify_path(str(old / "ckpt"))
    assert not report.ok and "size 63 bytes, manifest says 64" in report.bad[0].reason


def test_new_manifests_of_both_kinds_write_one_file_record(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.bin").write_bytes(b"abc")
    write_manifest(str(out), mm.Manifest(kind="test", files=mm.build_entries(str(out))))
    role = tmp_path / "global_step_1" / "actor"
    role.mkdir(parents=True)
    (role / "a.bin").write_bytes(b"abc")
    commit_manifest(str(role), rm.Manifest(1, 1, ["model"], rm.describe_files(str(role), ["a.bin"])))
    merge = json.loads((out / mm.MANIFEST_NAME).read_text())
    step = json.loads((role / rm.MANIFEST_NAME).read_text())
    assert merge["files"] == step["files"] == [{"path": "a.bin", "size": 3, "checksum": step["files"][0]["checksum"]}]
    assert merge["format_version"] == mm.FORMAT_VERSION and step["format"] == rm.FORMAT
    assert mm.verify(str(out)) == [] and rm.check_committed(str(role)).files == [
        mm.FileEntry("a.bin", 3, merge["files"][0]["checksum"])
    ]
    with pytest.raises(FileExistsError):  # the one put never writes over a committed manifest
        commit_manifest(str(role), rm.Manifest(1, 1, ["model"], []))
    with pytest.raises(FileExistsError):
        write_manifest(str(out), mm.Manifest(kind="test", files={}))
