"""slimckpt.layout.merge_manifest: a committed output verified against its manifest, and the rules for a target."""

from __future__ import annotations

import os

import pytest

import slimckpt.layout.merge_manifest as manifest
from slimckpt.engine import output_dir
from slimckpt.engine.output_dir import commit, write_manifest
from slimckpt.layout.merge_manifest import (
    CommitError,
    Manifest,
    build_entries,
    check_target,
    verify,
)


def committed_dir(tmp_path):
    partial = output_dir.prepare_partial(str(tmp_path / "out"))
    for name, data in {"a.bin": b"x" * 1000, "sub/b.json": b"{}"}.items():
        os.makedirs(os.path.dirname(os.path.join(partial, name)), exist_ok=True)
        with open(os.path.join(partial, name), "wb") as f:
            f.write(data)
    write_manifest(partial, Manifest(kind="test", files=build_entries(partial), tool_version="t"))
    commit(partial, str(tmp_path / "out"))
    return tmp_path / "out"


def test_commit_and_verify(tmp_path):
    out = committed_dir(tmp_path)
    assert not (tmp_path / "out.partial").exists()
    assert verify(str(out)) == []
    m = manifest.read_manifest(str(out))
    assert set(m.files) == {"a.bin", "sub/b.json"} and m.files["a.bin"].size == 1000
    assert Manifest.from_json(m.to_bytes().decode()) == m


@pytest.mark.parametrize(
    "damage,reason",
    [("flip", "manifest says"), ("truncate", "size 999"), ("remove", "missing"), ("extra", "not in the manifest")],
)
def test_verify_reports_bad_files(tmp_path, damage, reason):
    out = committed_dir(tmp_path)
    path = out / "a.bin"
    if damage == "flip":
        path.write_bytes(b"y" + b"x" * 999)
    elif damage == "truncate":
        path.write_bytes(b"x" * 999)
    elif damage == "remove":
        path.unlink()
    else:
        (out / "stray.txt").write_text("hi")
    bad = verify(str(out))
    assert len(bad) == 1 and reason in bad[0].reason
    assert bad[0].name == ("stray.txt" if damage == "extra" else "a.bin")


def test_verify_without_manifest(tmp_path):
    (tmp_path / "x").mkdir()
    assert [b.name for b in verify(str(tmp_path / "x"))] == [manifest.MANIFEST_NAME]
    (tmp_path / "x" / manifest.MANIFEST_NAME).write_text("{not json")
    assert "unreadable" in verify(str(tmp_path / "x"))[0].reason


def test_check_target_rules(tmp_path):
    check_target(str(tmp_path / "new"), overwrite=False)
    (tmp_path / "empty").mkdir()
    check_target(str(tmp_path / "empty"), overwrite=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(CommitError, match="not empty; pass --overwrite"):
        check_target(str(tmp_path / "full"), overwrite=False)
    check_target(str(tmp_path / "full"), overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CommitError, match="not a directory"):
        check_target(str(tmp_path / "file"), overwrite=True)
    with pytest.raises(CommitError, match="does not exist"):
        check_target(str(tmp_path / "no" / "such" / "dir"), overwrite=False)
