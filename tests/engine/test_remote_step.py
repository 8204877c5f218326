"""read.remote_step and write.upload on a medium given by its path: a step mirrored with only the records a
tool reads (checksums checked on the way, a flipped byte named by its source), and an output put in place
manifest last; and the tools' one line for a URL scheme no backend serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from slimckpt.engine.remote_step import fetch_step, records_of
from slimckpt.engine.upload import upload_dir
from slimckpt.layout.merge_manifest import MANIFEST_NAME, CommitError
from slimckpt.layout.resume_manifest import UncommittedCheckpoint

from ..helpers.merge_helpers import REPO, synthetic_dcp_step


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote") / "actor"
    optim = {"state": {"w": {"exp_avg": torch.full((64, 64), 7.0)}}}
    return synthetic_dcp_step(root, more={"optim": optim})


def _records(path: str) -> dict:
    return records_of(path, ["model."])


def test_a_mirror_keeps_the_model_records_and_zeros_the_rest(step, tmp_path):
    manifest = fetch_step(str(step), str(tmp_path / "m"), records=_records)
    mirror = tmp_path / "m"
    for entry in manifest.files:
        assert os.path.getsize(mirror / entry.path) == entry.size
        if not entry.path.endswith(".distcp"):
            assert (mirror / entry.path).read_bytes() == (step / entry.path).read_bytes()
    keep = _records(str(mirror / "dcp"))
    (name,) = keep  # one rank file
    src, got = (step / "dcp" / name).read_bytes(), (mirror / "dcp" / name).read_bytes()
    kept = sorted(keep[name])
    for begin, end in kept:
        assert got[begin:end] == src[begin:end]
    assert sum(e - b for b, e in kept) < len(src)  # the optimizer's record is not kept
    holes = bytearray(got)
    for begin, end in kept:
        holes[begin:end] = bytes(end - begin)
    assert not any(holes)
    assert (mirror / MANIFEST_NAME.replace("manifest.json", "slimckpt_resume.json")).exists()


def test_a_flipped_byte_is_named_by_its_source_and_every_record_is_kept_without_a_choice(step, tmp_path):
    full = fetch_step(str(step), str(tmp_path / "all"))
    for entry in full.files:
        assert (tmp_path / "all" / entry.path).read_bytes() == (step / entry.path).read_bytes()
    bad = tmp_path / "bad"
    subprocess.run(["cp", "-r", str(step), str(bad)], check=True)
    rank_file = next((bad / "dcp").glob("*.distcp"))
    data = bytearray(rank_file.read_bytes())
    data[-10] ^= 1
    rank_file.write_bytes(bytes(data))
    with pytest.raises(UncommittedCheckpoint, match=f"{bad}/dcp/{rank_file.name}: xxh3_128"):
        fetch_step(str(bad), str(tmp_path / "m2"), records=_records)


def test_an_output_is_uploaded_manifest_last_and_a_committed_one_is_kept_without_overwrite(tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "model.safetensors").write_bytes(os.urandom(3 << 20))
    (out / "sub" / "a.json").write_text("{}")
    (out / MANIFEST_NAME).write_text(json.dumps({"files": {}}))
    target = tmp_path / "target"
    (target / "stale").mkdir(parents=True)
    (target / "stale" / "left").write_text("a killed upload's")  # uncommitted: removed
    files = upload_dir(str(out), str(target), overwrite=False)
    assert files == sorted(["model.safetensors", "sub/a.json", MANIFEST_NAME])
    assert sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()) == files
    assert (target / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    with pytest.raises(CommitError, match="holds a committed output; pass --overwrite"):
        upload_dir(str(out), str(target), overwrite=False)
    upload_dir(str(out), str(target), overwrite=True)
    (out / MANIFEST_NAME).unlink()
    with pytest.raises(CommitError, match="only a committed output is uploaded"):
        upload_dir(str(out), str(tmp_path / "t2"), overwrite=False)


@pytest.mark.parametrize(
    "args",
    [
        ["merge", "--local_dir", "gs://b/x", "--target_dir", "{tmp}/o"],
        ["merge", "--local_dir", "{tmp}/x", "--target_dir", "gs://b/x"],
        ["verify", "gs://b/x"],
        ["convert", "gs://b/global_step_1", "--to", "verl", "--world-size", "1", "--target_dir", "{tmp}/o"],
    ],
)
def test_a_url_no_backend_serves_is_refused_in_one_line(args, tmp_path):
    args = [a.format(tmp=tmp_path) for a in args]
    out = subprocess.run([sys.executable, "-m", "slimckpt.cli", *args], capture_output=True, text=True, cwd=REPO)
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1, out.stderr
    assert "no storage backend for gs://" in lines[0] and not (tmp_path / "o").exists()
