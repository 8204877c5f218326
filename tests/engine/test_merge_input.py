"""slimckpt merge's input (engine/merge_input: `check_source` before any import, `open_source`) on checkpoints
made in-process (plain tensors, no torchrun): every bad input ends in a one-line error, a nonzero exit and
nothing committed. The output's side: tests/engine/test_output_dir.py, tests/hf/."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from ..helpers.merge_cli import (
    assert_nothing_committed,
    copy_ckpt,
    error_line,
    log_lines,
    merge_cli,
    ws2_checkpoint,
)
from ..helpers.merge_helpers import (
    synthetic_checkpoint,
)

slim_log = pytest.fixture(autouse=True, name="slim_log")(log_lines)
ckpt = pytest.fixture(scope="module", name="ckpt")(ws2_checkpoint)


def test_missing_rank_file(ckpt, tmp_path, capsys):
    bad = copy_ckpt(ckpt, tmp_path / "actor")
    (bad / "model_world_size_2_rank_1.pt").unlink()
    rc, err = merge_cli(capsys, "--local_dir", str(bad), "--target_dir", str(tmp_path / "o"))
    assert rc == 1
    assert "model_world_size_2_rank_1.pt is missing" in error_line(err)
    assert_nothing_committed(tmp_path / "o")


def test_an_uncommitted_incremental_step_is_refused(ckpt, tmp_path, capsys):
    """An incremental-tier role dir (dcp/, no verl rank files) without slimckpt_resume.json (a save
    that never finished) is not merged: one line naming the manifest, the resume's own words."""
    role = tmp_path / "actor"
    (role / "dcp").mkdir(parents=True)
    (role / "dcp" / "__0_0.distcp").write_bytes(b"x")
    shutil.copy(ckpt / "fsdp_config.json", role / "fsdp_config.json")
    rc, err = merge_cli(capsys, "--local_dir", str(role), "--target_dir", str(tmp_path / "o"))
    assert rc == 1
    line = error_line(err)
    assert "slimckpt_resume.json" in line and "never finished" in line and "merge an earlier" in line
    assert "is missing" not in line
    assert_nothing_committed(tmp_path / "o")


def test_two_world_sizes(ckpt, tmp_path, capsys):
    bad = copy_ckpt(ckpt, tmp_path / "actor")
    shutil.copy(bad / "model_world_size_2_rank_0.pt", bad / "model_world_size_4_rank_3.pt")
    rc, err = merge_cli(capsys, "--local_dir", str(bad), "--target_dir", str(tmp_path / "o"))
    assert rc == 1
    line = error_line(err)
    assert "two world sizes" in line and "model_world_size_4_rank_3.pt" in line
    assert_nothing_committed(tmp_path / "o")


def test_a_wrong_local_dir_fails_before_torch_is_imported(ckpt, tmp_path):
    """The dir checks run before the merge's imports: the one-line error comes in milliseconds."""
    bad = copy_ckpt(ckpt, tmp_path / "actor")
    (bad / "model_world_size_2_rank_1.pt").unlink()
    code = (
        "import sys; from slimckpt import cli; "
        f"rc = cli.main(['merge', '--local_dir', {str(bad)!r}, '--target_dir', {str(tmp_path / 'o')!r}]); "
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)"
    )
    # the error comes before torch is imported, in about a second; 120 s is a hang
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split()[-2:] == ["NO-TORCH", "1"], proc.stdout + proc.stderr
    assert "model_world_size_2_rank_1.pt is missing" in proc.stderr


@pytest.mark.parametrize("damage", ["truncated", "foreign_pickle", "text", "empty", "list"])
def test_damaged_rank_file(ckpt, tmp_path, capsys, damage):
    bad = copy_ckpt(ckpt, tmp_path / "actor")
    path = bad / "model_world_size_2_rank_1.pt"
    if damage == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif damage == "foreign_pickle":
        import pickle

        path.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    elif damage == "text":
        path.write_text("not a checkpoint\n")
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        torch.save([torch.zeros(3)], path)
    rc, err = merge_cli(capsys, "--local_dir", str(bad), "--target_dir", str(tmp_path / "o"))
    assert rc == 1
    assert str(path) in error_line(err)
    assert_nothing_committed(tmp_path / "o")


def test_ranks_disagree_on_unsharded_tensor(tmp_path, capsys):
    def edit(rank, sd):
        if rank == 1:
            sd["model.norm.weight"] += 1.0

    bad = synthetic_checkpoint(tmp_path / "actor", world_size=2, per_rank_edit=edit)
    rc, err = merge_cli(capsys, "--local_dir", str(bad), "--target_dir", str(tmp_path / "o"))
    assert rc == 1
    line = error_line(err)
    assert "rank_1.pt" in line and "model.norm.weight" in line
    assert_nothing_committed(tmp_path / "o")


def test_ranks_disagree_on_keys(tmp_path, capsys):
    bad = synthetic_checkpoint(
        tmp_path / "actor", world_size=2, per_rank_edit=lambda r, sd: sd.pop("lm_head.weight") if r == 1 else None
    )
    rc, err = merge_cli(capsys, "--local_dir", str(bad), "--target_dir", str(tmp_path / "o"))
    assert rc == 1 and "rank_1.pt: its keys differ" in error_line(err)


def test_missing_metadata_files(ckpt, tmp_path, capsys):
    bad = copy_ckpt(ckpt, tmp_path / "a1")
    (bad / "fsdp_config.json").unlink()
    rc, err = merge_cli(capsys, "--local_dir", str(bad), "--target_dir", str(tmp_path / "o"))
    assert rc == 1 and "fsdp_config.json is missing" in error_line(err)
    bad = copy_ckpt(ckpt, tmp_path / "a2")
    shutil.rmtree(bad / "huggingface")
    rc, err = merge_cli(capsys, "--local_dir", str(bad), "--target_dir", str(tmp_path / "o"))
    assert rc == 1 and "huggingface/config.json is missing" in error_line(err)
    rc, err = merge_cli(capsys, "--local_dir", str(tmp_path / "nowhere"), "--target_dir", str(tmp_path / "o"))
    assert rc == 1 and "no such checkpoint directory" in error_line(err)
    assert_nothing_committed(tmp_path / "o")
