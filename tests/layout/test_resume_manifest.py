"""layout/resume_manifest: the incremental tier's manifest (the commit record, its file checks, the retention
guard, the tracker file) and its files shared between ranks for the load check."""

from __future__ import annotations

import json
import os

import pytest

import slimckpt.engine.resume_records as rr
import slimckpt.layout.resume_manifest as rm

from ..helpers.resume_dirs import commit_manifest as _commit
from ..helpers.resume_dirs import role_dir as _role_dir


def test_load_check_shares_bytes_evenly_across_ranks():
    # two big rank shards must go to different ranks, whatever their order in the manifest
    assert rm.share_by_bytes([100, 5, 3, 1, 100, 3], 2) == [0, 0, 1, 0, 1, 1]
    sizes = [100, 5, 3, 1, 100, 3]
    owner = rm.share_by_bytes(sizes, 2)
    per_rank = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(2)]
    assert max(per_rank) - min(per_rank) <= 5
    assert rm.share_by_bytes([7], 4) == [0]


def test_uncommitted_dir_is_refused_with_one_line(tmp_path):
    d = _role_dir(tmp_path, 5)
    with pytest.raises(rm.UncommittedCheckpoint) as info:
        rm.read_manifest(str(d))
    msg = str(info.value)
    assert "\n" not in msg and str(d) in msg and rm.MANIFEST_NAME in msg and "resume_from_path" in msg


def test_manifest_round_trip_and_file_checks(tmp_path):
    d = _role_dir(tmp_path, 5)
    written = _commit(d, 5)
    read = rm.read_manifest(str(d))
    assert read.files == written.files and read.global_step == 5 and read.files[0].checksum is not None
    rm.check_files(str(d), read.files, checksums=True)

    # same size, different bytes: only the checksum sees it
    (d / "dcp" / "__0_0.distcp").write_bytes(b"y" * 100)
    rm.check_files(str(d), read.files, checksums=False)
    with pytest.raises(rm.UncommittedCheckpoint, match="xxh3_128"):
        rm.check_files(str(d), read.files, checksums=True)
    (d / "dcp" / "__0_0.distcp").write_bytes(b"y" * 99)
    with pytest.raises(rm.UncommittedCheckpoint, match="99 bytes"):
        rm.check_files(str(d), read.files, checksums=False)
    os.remove(d / "dcp" / "__0_0.distcp")
    with pytest.raises(rm.UncommittedCheckpoint, match="missing"):
        rm.check_files(str(d), read.files, checksums=False)


def test_remove_manifest_uncommits(tmp_path):
    d = _role_dir(tmp_path, 1)
    _commit(d, 1)
    assert rm.has_manifest(str(d))
    rr.remove_manifest(str(d))
    assert not rm.has_manifest(str(d))
    assert not [n for n in os.listdir(d) if ".tmp." in n]


def test_other_format_is_refused(tmp_path):
    d = _role_dir(tmp_path, 1)
    (d / rm.MANIFEST_NAME).write_text(json.dumps({"format": "something-else/9"}))
    with pytest.raises(rm.UncommittedCheckpoint, match="something-else/9"):
        rm.read_manifest(str(d))


def test_tracker_is_atomic_and_never_moves_back(tmp_path):
    assert rm.read_tracker(str(tmp_path)) is None
    assert rr.write_tracker(str(tmp_path), 3)
    assert not rr.write_tracker(str(tmp_path), 2)
    assert rm.read_tracker(str(tmp_path)) == 3
    # verl reads it with int(f.read().decode())
    assert int((tmp_path / rm.TRACKER_NAME).read_bytes().decode()) == 3
    assert sorted(os.listdir(tmp_path)) == [rm.TRACKER_NAME]


def test_step_of_parses_verl_layout(tmp_path):
    assert rm.step_of(str(tmp_path / "global_step_12" / "actor")) == (str(tmp_path), 12)
    assert rm.step_of(str(tmp_path / "somewhere" / "actor")) is None


def test_retention_keeps_the_newest_and_the_tracker_step(tmp_path):
    paths = [str(tmp_path / f"global_step_{s}" / "actor") for s in (1, 2, 3)]
    keep, delete = rm.split_retention(paths, 1, protect=set())
    assert keep == paths[2:] and delete == paths[:2]
    # the tracker names step 2: it survives until the tracker moves on
    rr.write_tracker(str(tmp_path), 2)
    protect = rm.protected_dirs(paths)
    assert protect == {os.path.abspath(paths[1])}
    keep, delete = rm.split_retention(paths, 1, protect)
    assert keep == paths[1:] and delete == paths[:1]
    assert rm.split_retention(paths, None, set()) == (paths, [])
    assert rm.split_retention(paths, 0, set()) == (paths, [])
